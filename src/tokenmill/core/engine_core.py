"""The engine core: ``step() = schedule -> execute -> update``, plus add and abort.

Synchronous and single-threaded: callers (the offline ``LLM`` or the server's engine
thread) own the loop. Everything it returns is a frozen record, so the core could move
to another process unchanged.
"""

from __future__ import annotations

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
                 max_model_len: int) -> None:
        self.config = config
        self.executor = executor
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, max_model_len)
        self._pending: list[EngineCoreOutput] = []  # outputs of aborts, sent with the next step
        # called in each step once the scheduler has moved requests (before the forward
        # pass), so a caller can publish the waiting queue while the step computes
        self.on_scheduled: Callable[[], None] | None = None

    def add_request(self, core_request: EngineCoreRequest) -> None:
        if core_request.req_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {core_request.req_id!r}")
        self.scheduler.add_request(Request(core_request))

    def abort_requests(self, req_ids: Iterable[str],
                       reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish the requests now (blocks freed); their outputs go out with the next step."""
        for request in self.scheduler.finish_requests(req_ids, reason):
            self._pending.append(self.scheduler.make_output(request, ()))

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
            )
        return EngineCoreOutputs(tuple(outputs), self.scheduler.make_stats(), iteration)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if not self.scheduler.has_unfinished_requests():
            assert self.kv.pool.num_used_blocks == 0, "blocks held with no request running"
            assert self.scheduler.num_tokens_waiting == 0 == self.scheduler.num_tokens_waiting_raw
