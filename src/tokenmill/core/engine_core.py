"""The engine core: ``step() = schedule -> execute -> update``, plus add and abort.

Synchronous and single-threaded: the step loop (``engine.loop``, run in the engine
process for the server and in the caller's thread for the offline ``LLM``) calls it.
Everything it returns is a frozen record, so its outputs cross a process boundary
unchanged. Hooks are given to the constructor and never rebound.

Structured outputs: ``add_request`` starts the request's grammar (``GrammarCompiler``:
compiled on a background thread, or found in its cache), and each step first looks at
the grammars still compiling: a ready one lets its request be scheduled, a failed one
(a grammar that does not compile, or takes longer than the compile timeout) finishes
its request with reason ``error``. While nothing but compiling requests is left,
``can_step`` is False: the caller waits (``wait``) instead of stepping. The wake-up it
waits on is set when a compilation ends (the compiler's ``on_compiled``) and by ``wake``
(a caller's new message); ``wait`` never outlasts the earliest compile deadline.

Stop strings: they are matched here, over the text the client will see (the tokenizer
is built from the ``Vocabulary`` on the first request that has stop strings), and a
request stops on the token that completes one (``Scheduler.check_stop``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import tokenizers

from tokenmill.config import EngineConfig
from tokenmill.core.detokenizer import IncrementalDetokenizer
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
                 max_model_len: int, kv_window: int | None = None,
                 on_scheduled: Callable[[SchedulerStats], None] | None = None) -> None:
        """``kv_window``: the sliding window of every layer of the model, where all of them
        have one (blocks behind it return to the pool: ``KVCacheManager``); None else.
        ``on_scheduled`` is called in each step once the scheduler has moved requests,
        before the forward pass, with its gauges: a caller publishes the waiting queue
        while the step computes."""
        self.config = config
        self.executor = executor
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 kv_window)
        self.scheduler = Scheduler(config, self.kv, max_model_len)
        self._pending: list[EngineCoreOutput] = []  # outputs of aborts, sent with the next step
        self._on_scheduled = on_scheduled
        self._wakeup = threading.Event()  # see the module docstring
        self.grammars = GrammarCompiler(config.structured_output_compile_timeout,
                                        on_compiled=self._wakeup.set)
        self._compiling: dict[str, Request] = {}  # requests whose grammars are not ready
        self._decoder: tokenizers.Tokenizer | None = None  # for stop strings, once needed

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        """The tokenizer that structured outputs are compiled for (see ``GrammarCompiler``)
        and stop strings matched with."""
        self.grammars.set_vocabulary(vocabulary)
        self._decoder = None

    def add_request(self, core_request: EngineCoreRequest) -> None:
        if core_request.req_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {core_request.req_id!r}")
        request = Request(core_request)
        params = core_request.sampling_params
        if params.structured_output is not None:
            request.grammar = self.grammars.start(params.structured_output)
            self._compiling[request.req_id] = request
        decoder = self._stop_decoder() if params.stop else None
        if decoder is not None:
            request.stop_text = IncrementalDetokenizer(
                decoder, core_request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output)
        self.scheduler.add_request(request)
        if params.stop and decoder is None:
            self.abort_requests([request.req_id], FinishReason.ERROR,
                                "stop strings need the tokenizer, which this engine was not given")

    def _stop_decoder(self) -> tokenizers.Tokenizer | None:
        """The tokenizer stop strings are matched with: the vocabulary's, built once."""
        vocabulary = self.grammars.vocabulary
        if self._decoder is None and vocabulary is not None:
            self._decoder = tokenizers.Tokenizer.from_str(vocabulary.tokenizer_json)
        return self._decoder

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

    def wake(self) -> None:
        """End a ``wait`` now (from any thread): a caller has something new for the core."""
        self._wakeup.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until woken (a grammar compilation ended, or ``wake``), for at most
        ``timeout`` seconds and never past the earliest compile deadline of the requests
        waiting for their grammars; whether it was woken. Each wake-up ends one wait."""
        deadlines = [r.grammar.deadline for r in self._compiling.values() if r.grammar]
        if deadlines:
            until_deadline = max(0.0, min(deadlines) - time.monotonic())
            timeout = until_deadline if timeout is None else min(timeout, until_deadline)
        woken = self._wakeup.wait(timeout)
        self._wakeup.clear()
        return woken

    def abort_all(self, reason: FinishReason) -> None:
        """``abort_requests`` for every request the core holds."""
        self.abort_requests(list(self.scheduler.requests), reason)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def step(self) -> EngineCoreOutputs:
        start = time.monotonic()
        self._poll_grammars()
        scheduler_output = self.scheduler.schedule()
        if self._on_scheduled is not None:
            self._on_scheduled(self.scheduler.make_stats())
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
