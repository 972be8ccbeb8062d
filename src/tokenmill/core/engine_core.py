"""The engine core: ``step() = schedule -> execute -> update``, plus add and abort.

Synchronous and single-threaded: callers (the offline ``LLM`` or the server's engine
thread) own the loop. Everything it returns is a frozen record, so the core could move
to another process unchanged.

Structured outputs: ``add_request`` starts the request's grammar (``GrammarCompiler``:
compiled on a background thread, or found in its cache), and each step first looks at
the grammars still compiling: a ready one lets its request be scheduled, a failed one
(a grammar that does not compile, or takes longer than the compile timeout) finishes
its request with reason ``error``. While nothing but compiling requests is left,
``can_step`` is False: the caller waits (``wait_for_grammars``) instead of stepping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.records import FinishReason, IterationStats, SchedulerStats
from tokenmill.core.request import EngineCoreRequest, Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tokenmill.structured.compiler import GrammarCompiler, Vocabulary
from tokenmill.structured.grammar import GrammarError


class StepFailed(RuntimeError):
    """The model raised during a step (the cause is chained).

    Only that step's requests are affected: they are finished with reason ``error``,
    their blocks freed (none of the failed step's blocks entered the prefix cache), and
    ``outputs`` holds their final outputs. The core is ready for its next step.
    """

    def __init__(self, outputs: EngineCoreOutputs, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.outputs = outputs


class ModelExecutor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: ModelExecutor, num_kv_blocks: int,
                 max_model_len: int, kv_window: int | None = None) -> None:
        """``kv_window``: the sliding window of every layer of the model, where all of them
        have one (blocks behind it return to the pool: ``KVCacheManager``); None else."""
        self.config = config
        self.executor = executor
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 kv_window)
        self.scheduler = Scheduler(config, self.kv, max_model_len)
        self._pending: list[EngineCoreOutput] = []  # outputs of aborts, sent with the next step
        # called in each step once the scheduler has moved requests (before the forward
        # pass), so a caller can publish the waiting queue while the step computes
        self.on_scheduled: Callable[[], None] | None = None
        self.grammars = GrammarCompiler(config.structured_output_compile_timeout)
        self._compiled = threading.Event()  # set when a grammar compilation ends
        self.grammars.on_compiled = self._compiled.set
        self._compiling: dict[str, Request] = {}  # requests whose grammars are not ready

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        """The tokenizer that structured outputs are compiled for (see ``GrammarCompiler``)."""
        self.grammars.set_vocabulary(vocabulary)

    def add_request(self, core_request: EngineCoreRequest) -> None:
        if core_request.req_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {core_request.req_id!r}")
        request = Request(core_request)
        constraint = core_request.sampling_params.structured_output
        if constraint is not None:
            request.grammar = self.grammars.start(constraint)
            self._compiling[request.req_id] = request
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: Iterable[str],
                       reason: FinishReason = FinishReason.ABORT,
                       error: str | None = None) -> None:
        """Finish the requests now (blocks freed); their outputs go out with the next step."""
        for request in self.scheduler.finish_requests(req_ids, reason):
            self._compiling.pop(request.req_id, None)
            request.error = error
            self._pending.append(self.scheduler.make_output(request, ()))

    def _poll_grammars(self) -> None:
        """Let requests whose grammars are ready be scheduled; fail those whose failed."""
        for req_id, request in list(self._compiling.items()):
            assert request.grammar is not None
            try:
                ready = request.grammar.poll()
            except GrammarError as e:
                self.abort_requests([req_id], FinishReason.ERROR, f"structured output: {e}")
                continue
            if ready:
                del self._compiling[req_id]

    def can_step(self) -> bool:
        """Whether a step can do anything now: False while every unfinished request waits
        for its grammar to compile (and no output is pending)."""
        self._poll_grammars()
        return bool(self._pending or self.scheduler.running
                    or self.scheduler.num_waiting > len(self._compiling))

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a grammar compilation ends, or ``timeout`` seconds."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    def abort_all(self, reason: FinishReason) -> None:
        """``abort_requests`` for every request the core holds."""
        self.abort_requests(list(self.scheduler.requests), reason)

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's gauges now."""
        return self.scheduler.make_stats()

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(self) -> EngineCoreOutputs:
        start = time.monotonic()
        self._poll_grammars()
        scheduler_output = self.scheduler.schedule()
        if self.on_scheduled is not None:
            self.on_scheduled()
        if scheduler_output.is_empty:
            runner_output = ModelRunnerOutput(sampled={})
        else:
            try:
                runner_output = self.executor.execute(scheduler_output)
            except Exception as error:
                self.abort_requests([r.req_id for r in scheduler_output.requests],
                                    FinishReason.ERROR)
                outputs, self._pending = tuple(self._pending), []
                raise StepFailed(EngineCoreOutputs(outputs, self.scheduler.make_stats(), None),
                                 error) from error
        result = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, self._pending = self._pending + result.outputs, []
        num_preemptions, queries, hits = self.scheduler.take_step_counters()
        iteration = None
        if not scheduler_output.is_empty:
            iteration = IterationStats(
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
                num_prompt_tokens=result.num_prompt_tokens,
                num_cached_prompt_tokens=result.num_cached_prompt_tokens,
                num_generation_tokens=result.num_generation_tokens,
                batch_size=len(scheduler_output.requests),
                step_time=time.monotonic() - start,
                forward_time=runner_output.forward_time,
                num_preemptions=num_preemptions,
                prefix_cache_queries=queries,
                prefix_cache_hits=hits,
                num_drafts=result.num_drafts,
                num_draft_tokens=result.num_draft_tokens,
                num_accepted_tokens=result.num_accepted_tokens,
                grammar_compile_times=self.grammars.take_compile_times(),
            )
        return EngineCoreOutputs(tuple(outputs), self.scheduler.make_stats(), iteration)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.scheduler.has_unfinished_requests():
            assert self.kv.pool.num_used_blocks == 0, "blocks held with no request running"
            assert self.scheduler.num_tokens_waiting == 0 == self.scheduler.num_tokens_waiting_raw
