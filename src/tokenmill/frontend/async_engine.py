"""The server's engine client: the engine core runs its step loop on one thread, the
server's event loop on another; each API request gets its own asyncio stream of
``ChoiceDelta``s.

    event loop thread                         engine thread (``run``)
    -----------------                         -----------------------
    add_request() --(inbox: add/abort)------> drain inbox, core.step()
    RequestStream  <--call_soon_threadsafe--- EngineCoreOutputs
      (detokenise, stop strings, stats)

Detokenisation, stop strings and stats maths run on the event loop, off the step
loop. An abort reaches the core before its next step. When the core goes idle it
publishes its stats once more, so gauges read zero as soon as the last request ends.

NOTE: run the step loop on the thread that loaded the model. PyTorch's OpenMP keeps one
worker pool per calling thread; a second pool oversubscribes the cores, OpenMP then
stops spin-waiting between kernels, and a decode step gets about 1.5x slower.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenmill.core.engine_core import EngineCore
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import EngineCoreOutput, EngineCoreOutputs
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.frontend.request_log import RequestLog
from tokenmill.frontend.request_state import ChoiceState
from tokenmill.metrics.records import FinishReason, RequestEvent, RequestEventType
from tokenmill.metrics.stats import RequestStats
from tokenmill.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")


class AdmissionRejected(Exception):
    """The waiting queue is at its configured cap; ``reason`` names the cap."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class _Abort:
    req_ids: list[str]
    reason: FinishReason


class RequestStream:
    """The deltas of one API request's choices, in the order the engine produced them."""

    def __init__(self, engine: AsyncEngine, choices: list[ChoiceState]) -> None:
        self.engine = engine
        self.choices = {c.req_id: c for c in choices}
        self._by_index = choices
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._num_unfinished = len(choices)
        self.error: str | None = None  # why the engine ended this request, on finish "error"
        self._closed = False  # the reader went away

    def num_cached_tokens(self, index: int) -> int:
        """Prompt tokens that choice ``index`` found in the prefix cache."""
        return self._by_index[index].num_cached_tokens

    def _on_output(self, out: EngineCoreOutput) -> None:
        choice = self.choices[out.req_id]
        delta = choice.process(out)
        if choice.take_stop_request():
            self.engine.abort_choices([out.req_id], FinishReason.STOP)
        if delta is None:
            return
        if self._closed:  # nobody reads any more: finish the accounting here
            if delta.finished:
                self._finish(choice.mark_emitted(delta))
            return
        self._queue.put_nowait(delta)

    def _finish(self, delta: ChoiceDelta) -> None:
        self._num_unfinished -= 1
        self.engine.on_choice_finished(self._by_index[delta.index], delta.stats)

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        try:
            while self._num_unfinished:
                item = await self._queue.get()
                delta = self._by_index[item.index].mark_emitted(item)
                if delta.finished:
                    self._finish(delta)
                yield delta
        finally:
            self.close()

    def close(self) -> None:
        """The reader is gone: abort what is unfinished and account for what did finish.

        Idempotent; also for a stream that was never iterated (a client that left before
        its response started).
        """
        self._closed = True
        if self._num_unfinished:
            self.abort()
            while not self._queue.empty():  # queued deltas will never be read
                item = self._queue.get_nowait()
                if item.finished:
                    self._finish(self._by_index[item.index].mark_emitted(item))

    def abort(self) -> None:
        """Stop every unfinished choice (client gone); the core frees their blocks next step."""
        self.engine.abort_choices([c.req_id for c in self.choices.values() if not c.finished],
                                  FinishReason.ABORT)


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer, step_sinks=(), finished_sinks=(),
                 max_num_queued_requests: int | None = None,
                 max_num_queued_tokens: int | None = None,
                 request_log: RequestLog | None = None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.step_sinks = list(step_sinks)  # record_step(SchedulerStats, IterationStats | None)
        self.finished_sinks = list(finished_sinks)  # record_finished(RequestStats)
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self.request_log = request_log  # recent requests' lifecycles, for the dashboard
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # by choice (engine request) id
        self._pending_requests = 0  # added but not yet taken by the engine thread
        self._pending_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attached = threading.Event()
        self._stopping = False

    # --------------------------------------------------------------- lifecycle
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs to ``loop`` (the server's event loop); ``run`` starts stepping."""
        self._loop = loop
        self._attached.set()

    def shutdown(self) -> None:
        """Make ``run`` return after the current step."""
        self._stopping = True
        self._attached.set()
        self._wakeup.set()

    # ---------------------------------------------------------------- requests
    def add_request(self, core_requests: list[EngineCoreRequest], arrival_ts: float,
                    request_id: str = "") -> RequestStream:
        """Admit an API request and open its stream.

        ``core_requests`` holds one engine request per choice, for every prompt, in the
        order of the API's choice indices. ``request_id`` names the API request in the
        request log.
        """
        self._admit(core_requests)
        for r in core_requests:
            if r.req_id in self._streams:
                raise ValueError(f"request id {r.req_id!r} is already in use")
        now = time.monotonic()
        frontend_events = [RequestEvent(RequestEventType.ARRIVED, arrival_ts),
                           RequestEvent(RequestEventType.INPUT_PROCESSED, now)]
        choices = [ChoiceState(i, r.req_id, self.tokenizer, list(r.prompt_token_ids),
                               r.sampling_params, frontend_events)
                   for i, r in enumerate(core_requests)]
        stream = RequestStream(self, choices)
        if self.request_log is not None:
            self.request_log.started(request_id, choices,
                                     [r.prompt_token_ids for r in core_requests])
        for r in core_requests:
            self._streams[r.req_id] = stream
            self._inbox.put(r)
        self._pending_requests += len(core_requests)
        self._pending_tokens += sum(len(r.prompt_token_ids) for r in core_requests)
        self._wakeup.set()
        return stream

    def _admit(self, core_requests: list[EngineCoreRequest]) -> None:
        sched = self.core.scheduler  # NOTE: plain int reads of the engine thread's sums
        cap = self.max_num_queued_requests
        waiting = sched.num_waiting + self._pending_requests
        if cap is not None and waiting + len(core_requests) > cap:
            raise AdmissionRejected(f"the server's queue is full ({cap} waiting requests)",
                                    "max_num_queued_requests")
        cap = self.max_num_queued_tokens
        tokens = sum(len(r.prompt_token_ids) for r in core_requests)
        if cap is not None and sched.num_tokens_waiting_raw + self._pending_tokens + tokens > cap:
            raise AdmissionRejected(f"the server's queue is full ({cap} waiting tokens)",
                                    "max_num_queued_tokens")

    def abort_choices(self, req_ids: list[str], reason: FinishReason) -> None:
        if req_ids:
            self._inbox.put(_Abort(req_ids, reason))
            self._wakeup.set()

    def on_choice_finished(self, choice: ChoiceState, stats: RequestStats | None) -> None:
        if stats is not None:
            for sink in self.finished_sinks:
                sink.record_finished(stats)
            if self.request_log is not None:
                self.request_log.finished(choice, stats)

    # ----------------------------------------------------------- engine thread
    def run(self) -> None:
        """The step loop: blocks until ``shutdown``; steps once ``attach`` gave it a loop."""
        self._attached.wait()
        idle_published = True
        while not self._stopping:
            try:
                self._drain_inbox()
                if not self.core.has_work():
                    if not idle_published:
                        self._publish(self.core.step())
                        self.core.check_integrity()
                        idle_published = True
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                idle_published = False
                self._publish(self.core.step())
            except Exception as error:  # noqa: BLE001 - the loop must survive to report it
                logger.exception("engine step failed")
                self._fail_all(error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Abort):
                self.core.abort_requests(item.req_ids, item.reason)
            else:
                self.core.add_request(item)
                self._loop.call_soon_threadsafe(self._taken, len(item.prompt_token_ids))

    def _taken(self, num_tokens: int) -> None:
        self._pending_requests -= 1
        self._pending_tokens -= num_tokens

    def _publish(self, outputs: EngineCoreOutputs) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        for sink in self.step_sinks:
            sink.record_step(outputs.scheduler_stats, outputs.iteration_stats)
        for out in outputs.outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.req_id]
            stream._on_output(out)

    def _fail_all(self, error: Exception) -> None:
        """A failed step ends every request in flight with finish reason ``error``
        (``RequestStream.error`` says why); the engine goes on serving new requests."""
        req_ids = list(self.core.scheduler.requests)
        self._loop.call_soon_threadsafe(self._mark_failed, req_ids, f"engine error: {error}")
        self.core.abort_requests(req_ids, FinishReason.ERROR)
        self._publish(self.core.step())

    def _mark_failed(self, req_ids: list[str], message: str) -> None:
        for req_id in req_ids:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.error = message
