"""The scheduler: which requests compute which tokens in the next step.

One token budget per step (``max_num_batched_tokens``) is shared by all requests, at
most ``max_num_seqs`` of them. Running requests are served first (decodes cost one
token each; a prompt still being chunked takes what the budget leaves), then waiting
requests join in arrival order. When blocks run out, the most recently arrived running
request is preempted: its blocks are freed, its output is kept, and it goes back to the
front of the waiting queue to be recomputed.

With ``scheduling_policy`` "priority" (as vLLM's), a request's rank is (priority, arrival
number), lower first, and both queues are kept in rank order: the waiting queue (a
preempted request goes back in its rank's place) and the running list, so requests are
served best first and the victim of a preemption is always the worst-ranked running
request (the list's tail, as above). Before each step, a ready waiting request that
outranks running ones and finds no room (blocks for its next chunk, or a seat within
``max_num_seqs``) preempts them, worst first, until it fits. With "fcfs" every
priority is 0 and the order is the one above.

With speculative decoding (``speculative_ngram`` K > 0) a running request that is about
to sample also computes up to K draft tokens (spec_decode.py), budget and blocks
permitting: drafts are dropped before anyone is preempted for them. No request drafts
while more than ``speculative_disable_by_batch_size`` requests run: a large batch is
no longer bound by reading the weights, and drafts would cost real compute. After the step
its computed tokens advance past the accepted drafts only, and blocks that held
nothing but rejected drafts go back to the pool.

A request with a structured output waits in the queue until its grammar has compiled
(``EngineCore`` compiles off the step): the scheduler passes over it, and the requests
behind it go ahead, keeping their order. Once running, its grammar follows its output:
``_commit`` feeds it each committed token, and the request stops (reason ``stop``) as
soon as the grammar is complete; drafts are cut to what the grammar accepts. A request
with stop strings stops (reason ``stop``) on the token that completes one: no token past
it is committed, and none is computed after that step.

An embedding request (``pooling``) is scheduled as a prompt like any other (the same
budget, chunks and blocks) but never samples: each of its chunks comes back with its
share of the pooled vector, which it adds up, and the step that computes its last
position finishes it (reason ``stop``) with the vector, its blocks freed. Mean and CLS
pooling take no prefix-cache hit (every position must be computed); a preemption
starts its pooling over.

Queue accounting (the tokens-waiting gauges) is kept as running sums that change only
when a request enters or leaves the waiting queue; nothing walks the queue per step::

    num_tokens_waiting_raw = sum over waiting r of (r.num_tokens - r.num_computed_tokens)
    num_tokens_waiting     = the same, less each r's prefix-cache hit looked up on entry

The scheduler is the only writer of Request state. It never touches torch.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache.block_pool import KVBlock
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.records import FinishReason, RequestEventType, SchedulerStats
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.spec_decode import NgramProposer
from tokenmill.core.types import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


@dataclass(slots=True)
class StepResult:
    """The outputs of one step's update, and the counts the iteration stats need."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.kv = kv
        self.proposer = (NgramProposer(config.speculative_ngram, config.ngram_min,
                                       config.ngram_max)
                         if config.speculative_ngram else None)
        self.speculative_max_batch = config.speculative_disable_by_batch_size
        self.by_priority = config.scheduling_policy == "priority"
        self._arrivals = itertools.count()
        self.requests: dict[str, Request] = {}
        # NOTE: finished requests may linger in ``waiting`` (lazy removal on abort);
        # ``num_waiting`` is the true count.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_waiting = 0
        self.num_tokens_waiting = 0
        self.num_tokens_waiting_raw = 0
        self._finished_req_ids: set[str] = set()
        self._prefilling_groups: dict[str, int] = {}
        # Per-step counters, reset by take_step_counters().
        self.num_preemptions_in_step = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- queue
    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        request.arrival = next(self._arrivals)
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        request.status = RequestStatus.WAITING
        request.queued_tokens_raw = request.num_tokens_to_compute
        hit = len(self.kv.find_cached_blocks(request)) * self.kv.block_size
        request.queued_tokens = request.queued_tokens_raw - hit
        self.num_waiting += 1
        self.num_tokens_waiting_raw += request.queued_tokens_raw
        self.num_tokens_waiting += request.queued_tokens
        request.record(RequestEventType.QUEUED)
        if self.by_priority:
            insort(self.waiting, request, key=_rank)
        else:
            (self.waiting.appendleft if front else self.waiting.append)(request)

    def _leave_queue(self, request: Request) -> None:
        self.num_waiting -= 1
        self.num_tokens_waiting_raw -= request.queued_tokens_raw
        self.num_tokens_waiting -= request.queued_tokens

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, tuple[int, ...]]] = []
        if self.by_priority:
            self._make_room_for_waiting()
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        finished, self._finished_req_ids = frozenset(self._finished_req_ids), set()
        return SchedulerOutput(tuple(self._describe(*entry) for entry in scheduled), finished)

    def _schedule_running(self, budget: int, out: list[tuple[Request, int, tuple[int, ...]]],
                          ) -> tuple[int, bool]:
        """Serve running requests in order, preempting from the tail when blocks run out."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens_to_compute, budget)
            drafts = self._propose_drafts(request, budget)
            while not self.kv.allocate(request, num_new + len(drafts)):
                if drafts:  # drafts never cost another request its place
                    drafts = ()
                    continue
                # NOTE: the victim is always at or after i, so nothing already in ``out``
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    return budget, preempted
            out.append((request, num_new, drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget, preempted

    def _make_room_for_waiting(self) -> None:
        """Preempt the worst-ranked running requests while the best ready waiting request
        outranks them and finds no room for its next chunk (blocks) or no seat."""
        head = next((r for r in self.waiting if not r.is_finished
                     and (r.grammar is None or r.grammar.ready)), None)
        if head is None:
            return
        while self.running and _rank(self.running[-1]) > _rank(head):
            cached = self._usable_cached_blocks(head)
            num_new = head.num_tokens - len(cached) * self.kv.block_size
            if self.enable_chunked_prefill:
                num_new = min(num_new, self.max_num_batched_tokens)
            if (len(self.running) < self.max_num_seqs
                    and self.kv.can_allocate(head, num_new, cached)):
                return
            self._preempt(self.running.pop())

    def _usable_cached_blocks(self, request: Request) -> list[KVBlock]:
        """The prefix-cache blocks ``request`` may start from: none for a pooling that
        reads every position (mean, CLS), whose rows must all be computed."""
        if request.pooling is not None and request.pooling.needs_every_token:
            return []
        return self.kv.find_cached_blocks(request)

    def _propose_drafts(self, request: Request, budget: int) -> tuple[int, ...]:
        """Drafts for a request about to sample, no more than its budget, ``max_tokens``
        and ``max_model_len`` leave room for after one sampled token."""
        if (self.proposer is None or request.num_tokens_to_compute != 1 or request.pooling
                or len(self.running) > self.speculative_max_batch):
            return ()
        room = min(budget, request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        drafts = self.proposer.propose(request.all_token_ids, room)
        if drafts and request.grammar is not None:
            drafts = drafts[:request.grammar.valid_drafts(drafts)]
        return drafts

    def _schedule_waiting(self, budget: int,
                          out: list[tuple[Request, int, tuple[int, ...]]]) -> None:
        compiling: list[Request] = []  # passed over: their grammars are not ready yet
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            if request.group_id in self._prefilling_groups and self.kv.enable_prefix_caching:
                break  # NOTE: wait for a sibling's prompt blocks to land in the prefix cache
            cached = self._usable_cached_blocks(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            self._leave_queue(request)
            self._count_cache_query(request, num_cached)
            request.num_computed_tokens = num_cached
            self._start_running(request)
            out.append((request, num_new, ()))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

    def _count_cache_query(self, request: Request, num_cached: int) -> None:
        if request.has_been_scheduled:  # back from a preemption
            request.counters.num_recomputed_tokens += request.num_tokens - num_cached
        else:
            request.num_cached_tokens = num_cached
        if self.kv.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached

    def _start_running(self, request: Request) -> None:
        now = time.monotonic()
        request.status = RequestStatus.RUNNING
        request.has_been_scheduled = True
        request.is_prefilling = True
        if request.group_id is not None:
            self._prefilling_groups[request.group_id] = (
                self._prefilling_groups.get(request.group_id, 0) + 1)
        request.record(RequestEventType.SCHEDULED, now)
        request.record(RequestEventType.PREFILLING, now)
        if self.by_priority:
            insort(self.running, request, key=_rank)
        else:
            self.running.append(request)

    def _end_prefill(self, request: Request) -> None:
        request.is_prefilling = False
        group = request.group_id
        if group is not None and group in self._prefilling_groups:
            self._prefilling_groups[group] -= 1
            if self._prefilling_groups[group] == 0:
                del self._prefilling_groups[group]

    def _preempt(self, request: Request) -> None:
        if request.is_prefilling:
            self._end_prefill(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.pooled = None
        request.counters.num_preemptions += 1
        self.num_preemptions_in_step += 1
        request.record(RequestEventType.PREEMPTED)
        self._enqueue(request, front=True)

    def _describe(self, request: Request, num_new: int,
                  drafts: tuple[int, ...]) -> ScheduledRequest:
        start = request.num_computed_tokens
        params = request.sampling_params
        below_min = request.num_output_tokens < params.min_tokens
        banned = frozenset()
        if below_min:
            banned = request.eos_token_ids | frozenset(params.stop_token_ids)
        return ScheduledRequest(
            req_id=request.req_id,
            token_ids=tuple(request.all_token_ids[start:start + num_new]) + drafts,
            start_pos=start,
            block_ids=self.kv.block_ids(request.req_id),
            sample=start + num_new == request.num_tokens and request.pooling is None,
            sampling_params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            mask_stop_tokens=banned,
            draft_token_ids=drafts,
            grammar=request.grammar,
            pooling=request.pooling,
        )

    # ---------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> StepResult:
        """Advance every scheduled request past the computed tokens; commit sampled ones."""
        result = StepResult()
        now = time.monotonic()
        for item in scheduler_output.requests:
            request = self.requests.get(item.req_id)
            if request is None:  # finished (aborted) while the step ran
                continue
            num_drafts = len(item.draft_token_ids)
            request.num_computed_tokens += len(item.token_ids) - num_drafts
            request.counters.model_forward_time += runner_output.forward_time
            self.kv.cache_computed_blocks(request)
            self.kv.release_behind_window(request)
            if request.pooling is not None:
                self._pool(request, runner_output.pooled.get(item.req_id), result)
                continue
            token_ids = runner_output.sampled.get(item.req_id)
            if not token_ids:
                continue
            committed = self._commit(request, token_ids, now, result)
            if num_drafts:
                self._settle_drafts(request, num_drafts, len(token_ids) - 1, result)
            logprobs = runner_output.logprobs.get(item.req_id)
            result.outputs.append(self.make_output(
                request, committed, logprobs[:len(committed)] if logprobs else None))
        return result

    def _pool(self, request: Request, part: list[float] | None, result: StepResult) -> None:
        """Add a chunk's share of an embedding request's vector; once its last position is
        computed, finish it with the vector (mean divided by the count, then normalised)."""
        pooling = request.pooling
        assert pooling is not None
        if part is not None:
            if pooling.kind == "mean" and request.pooled is not None:
                request.pooled = [a + b for a, b in zip(request.pooled, part, strict=True)]
            else:
                request.pooled = part
        if request.num_computed_tokens < request.num_tokens:
            return
        assert request.pooled is not None, "every chunk of a pooling request pools"
        vector = request.pooled
        if pooling.kind == "mean":
            vector = [x / request.num_tokens for x in vector]
        if pooling.normalize:
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            vector = [x / norm for x in vector]
        result.num_prompt_tokens += request.num_prompt_tokens
        result.num_cached_prompt_tokens += request.num_cached_tokens
        self.running.remove(request)
        self.finish(request, FinishReason.STOP)
        result.outputs.append(self.make_output(request, (), embedding=tuple(vector)))

    def _settle_drafts(self, request: Request, num_drafts: int, num_accepted: int,
                       result: StepResult) -> None:
        """Count a verification; keep the accepted drafts' KV and free what only held
        rejected ones (nothing to do for a request that finished)."""
        request.counters.num_draft_tokens += num_drafts
        request.counters.num_accepted_tokens += num_accepted
        result.num_drafts += 1
        result.num_draft_tokens += num_drafts
        result.num_accepted_tokens += num_accepted
        if request.is_finished:
            return
        request.num_computed_tokens += num_accepted
        self.kv.cache_computed_blocks(request)
        self.kv.release_behind_window(request)
        self.kv.trim(request)

    def _commit(self, request: Request, token_ids: tuple[int, ...], now: float,
                result: StepResult) -> tuple[int, ...]:
        """Append the step's tokens up to the first that stops the request; return them."""
        count = 0
        reason = None
        for token_id in token_ids:
            request.append_output_token(token_id)
            count += 1
            if request.grammar is not None and not request.grammar.accept(token_id):
                request.error = f"the grammar rejected a sampled token: {request.grammar.error}"
                reason = FinishReason.ERROR
                break
            reason = self.check_stop(request)
            if reason is not None:
                break
        request.record(RequestEventType.NEW_TOKENS, now, num_tokens=count)
        result.num_generation_tokens += count
        if request.is_prefilling:
            self._end_prefill(request)
            request.record(RequestEventType.DECODING, now)
            if request.num_output_tokens == count:  # the request's first tokens
                result.num_prompt_tokens += request.num_prompt_tokens
                result.num_cached_prompt_tokens += request.num_cached_tokens
        if reason is not None:
            self.running.remove(request)
            self.finish(request, reason)
        return token_ids[:count]

    @staticmethod
    def make_output(request: Request, new_token_ids: tuple[int, ...],
                    new_logprobs: tuple | None = None,
                    embedding: tuple[float, ...] | None = None) -> EngineCoreOutput:
        finished = request.finish_reason is not None
        return EngineCoreOutput(
            req_id=request.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            events=request.take_events(),
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            counters=replace(request.counters) if finished else None,
            error=request.error if finished else None,
            stop_string=request.stop_text.stop_reason if request.stop_text else None,
            embedding=embedding,
        )

    # ---------------------------------------------------------------- finish
    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        """Finish (abort) requests wherever they are; their blocks are freed at once."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.WAITING:
                self._leave_queue(request)  # the queue entry itself is dropped lazily
            else:
                self.running.remove(request)
            self.finish(request, reason)
            finished.append(request)
        return finished

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.is_prefilling:
            self._end_prefill(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.record(RequestEventType.FINISHED, finish_reason=reason)
        self.kv.free(request)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    def check_stop(self, request: Request) -> FinishReason | None:
        """Why the request stops after its newest token, if it does. A structured output
        stops once its grammar is complete, whatever ``min_tokens`` and ``ignore_eos`` say
        (the grammar would allow nothing but EOS). A stop string stops it on the token
        that completes it (its output then says which: ``stop_string``) where nothing
        else does."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and (
                (not params.ignore_eos and last in request.eos_token_ids)
                or last in params.stop_token_ids):
            return FinishReason.STOP
        if request.grammar is not None and request.grammar.is_finished():
            return FinishReason.STOP
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len):
            return FinishReason.LENGTH
        if request.stop_text is not None:
            request.stop_text.add_tokens((last,))
            if request.stop_text.stopped:
                return FinishReason.STOP
        return None

    # ----------------------------------------------------------------- stats
    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            kv_cache_tokens_used=self.kv.num_used_tokens,
            num_tokens_waiting=self.num_tokens_waiting,
            num_tokens_waiting_raw=self.num_tokens_waiting_raw,
        )

    def take_step_counters(self) -> tuple[int, int, int]:
        """(preemptions, prefix-cache queries, hits) since the last call."""
        counters = (self.num_preemptions_in_step, self.prefix_cache_queries, self.prefix_cache_hits)
        self.num_preemptions_in_step = self.prefix_cache_queries = self.prefix_cache_hits = 0
        return counters


def _rank(request: Request) -> tuple[int, int]:
    """A request's place under the priority policy: lower priority values, then earlier
    arrivals, first."""
    return request.priority, request.arrival
