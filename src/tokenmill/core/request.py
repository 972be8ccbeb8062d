"""An engine request: the token sequence one choice is generating, and its progress.

Invariants (the scheduler is the only writer):

    all_token_ids = prompt_token_ids + output_token_ids
    0 <= num_computed_tokens <= num_tokens = len(all_token_ids)

    |<-------------- prompt -------------->|<--- output --->|
    |<--- computed (KV in cache) --->|<--- to compute --->|

A request is never "in prefill" or "in decode" as a code path: each step it computes
``num_tokens - num_computed_tokens`` tokens (up to the budget), and when it catches up
the sampler commits the next token. A preempted request drops its KV cache
(``num_computed_tokens = 0``) but keeps its output, which it recomputes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from tokenmill.core.detokenizer import IncrementalDetokenizer
from tokenmill.core.records import FinishReason, RequestCounters, RequestEvent, RequestEventType
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.structured.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """What the frontend hands the core: a tokenised, validated request for one choice."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams  # n == 1; max_tokens resolved (never None)
    eos_token_ids: frozenset[int]
    group_id: str | None = None  # the API request this choice belongs to, for n > 1
    priority: int = 0  # lower runs first (scheduling policy "priority"; else always 0)
    # an embedding request: its prompt pooled, no token sampled (sampling_params unused)
    pooling: PoolingParams | None = None


class Request:
    """Mutable engine-side state of one EngineCoreRequest."""

    def __init__(self, core_request: EngineCoreRequest) -> None:
        params = core_request.sampling_params
        assert params.max_tokens is not None, "the frontend resolves max_tokens"
        self.req_id = core_request.req_id
        self.group_id = core_request.group_id
        self.priority = core_request.priority
        self.arrival = 0  # the scheduler's arrival number: ties of priority go in this order
        self.pooling = core_request.pooling
        # An embedding request's pooled state so far (the model runner's partial results);
        # reset by a preemption, which recomputes every position.
        self.pooled: list[float] | None = None
        self.sampling_params = params
        self.eos_token_ids = core_request.eos_token_ids
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.all_token_ids = list(core_request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Prefix-cache hash of each full block of all_token_ids, extended lazily.
        self.block_hashes: list[int] = []
        # Queue accounting: this request's contribution to the scheduler's running sums,
        # fixed when it entered the waiting queue (see Scheduler).
        self.queued_tokens_raw = 0
        self.queued_tokens = 0
        # Lifetime counters reported with the finished request.
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.counters = RequestCounters()
        self.is_prefilling = False  # between SCHEDULED and the step that commits a token
        self.has_been_scheduled = False
        self.events: list[RequestEvent] = []  # drained into each step's outputs
        # The constraint's grammar (structured output): compiling until ready, then fed
        # every committed token; kept through preemptions, like the output.
        self.grammar: RequestGrammar | None = None
        self.error: str | None = None  # why it finished with reason "error", when known
        # The output's text as the client will see it, for a request with stop strings:
        # fed every committed token, it says when a stop string has completed.
        self.stop_text: IncrementalDetokenizer | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens  # type: ignore[return-value]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record(self, event_type: RequestEventType, ts: float | None = None, *,
               num_tokens: int = 0, finish_reason: FinishReason | None = None) -> None:
        self.events.append(RequestEvent(event_type, time.monotonic() if ts is None else ts,
                                        num_tokens, finish_reason))

    def take_events(self) -> tuple[RequestEvent, ...]:
        events, self.events = tuple(self.events), []
        return events
