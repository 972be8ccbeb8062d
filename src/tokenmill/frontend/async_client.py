"""The server's asyncio face of an ``EngineClient`` (``engine.client``: in the server, the
engine process at the far end of a pipe): each API request gets its own asyncio stream
of ``ChoiceDelta``s.

    event loop thread                  receiver (``run``)               step loop
    -----------------                  ------------------               ---------
    add_request()/abort -- EngineClient: EngineCoreRequest / Abort ---> core.step()
    RequestStream <--call_soon_threadsafe-- client.get_output() <-- StepReport
      (detokenise, hold back what may be a stop string, stats)

Detokenisation and stats maths run on the event loop, off the step loop; stop strings
end a choice in the engine, on the token that completes one. An abort reaches the core
before its next step. Each step reports the scheduler's gauges twice: once it has
scheduled (``QueueState``) and once it is done (its ``StepReport``); step sinks see
both. Admission control counts the waiting queue as the core last reported it plus what
was sent since and not yet taken by the core.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from tokenmill.core.records import FinishReason, SchedulerStats
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import EngineCoreOutput
from tokenmill.engine.client import EngineClient
from tokenmill.engine.messages import QueueState, StepReport
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.frontend.request_log import RequestLog
from tokenmill.frontend.request_state import ChoiceState, open_choices
from tokenmill.metrics.stats import RequestStats
from tokenmill.structured.compiler import Vocabulary
from tokenmill.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")


class AdmissionRejected(Exception):
    """The waiting queue is at its configured cap; ``reason`` names the cap."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestStream:
    """The deltas of one API request's choices, in the order the engine produced them."""

    def __init__(self, engine: AsyncEngineClient, choices: list[ChoiceState],
                 request_id: str = "") -> None:
        self.engine = engine
        self.request_id = request_id  # the API request's id, for the log
        self.choices = {c.req_id: c for c in choices}  # by engine request id
        self.choices_in_order = choices  # by the API's choice index
        self._queue: asyncio.Queue[ChoiceDelta] = asyncio.Queue()
        self._num_unfinished = len(choices)
        self.error: str | None = None  # why the engine ended this request, on finish "error"
        self._closed = False  # the reader went away
        engine.stream_opened(self)

    def num_cached_tokens(self, index: int) -> int:
        """Prompt tokens that choice ``index`` found in the prefix cache."""
        return self.choices_in_order[index].num_cached_tokens

    def _on_output(self, out: EngineCoreOutput) -> None:
        choice = self.choices[out.req_id]
        for delta in choice.process(out):
            if not self._closed:
                self._queue.put_nowait(delta)
            elif delta.finished:  # nobody reads any more: finish the accounting here
                self._finish(choice.mark_emitted(delta))

    def _finish(self, delta: ChoiceDelta) -> None:
        if self._closed:
            # how each choice its client left ended, as the metrics count it: aborted, or
            # finished (the engine got there before the abort did)
            logger.info("request %s: client disconnected; choice %d ended: %s",
                        self.request_id, delta.index, delta.finish_reason)
        self._num_unfinished -= 1
        self.engine.on_choice_finished(self.choices_in_order[delta.index], delta.stats)

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        try:
            while self._num_unfinished:
                item = await self._queue.get()
                delta = self.choices_in_order[item.index].mark_emitted(item)
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
        self.engine.stream_closed(self)
        if self._num_unfinished:
            self.abort()
            while not self._queue.empty():  # queued deltas will never be read
                item = self._queue.get_nowait()
                if item.finished:
                    self._finish(self.choices_in_order[item.index].mark_emitted(item))

    def abort(self) -> None:
        """Stop every unfinished choice (client gone); the core frees their blocks next step."""
        self.engine.abort_choices([c.req_id for c in self.choices.values() if not c.finished],
                                  FinishReason.ABORT)


class AsyncEngineClient:
    """The server's client of the engine behind ``client`` (see the module docstring)."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, step_sinks=(),
                 finished_sinks=(), max_num_queued_requests: int | None = None,
                 max_num_queued_tokens: int | None = None,
                 request_log: RequestLog | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.step_sinks = list(step_sinks)  # record_step(SchedulerStats, IterationStats | None)
        self.finished_sinks = list(finished_sinks)  # record_finished(RequestStats)
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self.request_log = request_log  # recent requests' lifecycles, for the dashboard
        self._streams: dict[str, RequestStream] = {}  # by choice (engine request) id
        self._open_streams: set[RequestStream] = set()  # responses not yet closed
        self.consecutive_failures = 0  # failed steps since the last good one
        self._queue_stats = SchedulerStats()  # the core's latest gauges
        self._pending_requests = 0  # sent but not yet taken by the core
        self._pending_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attached = threading.Event()
        self.alive = True  # False once the engine loop has ended (or its process died)

    # --------------------------------------------------------------- lifecycle
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver outputs to ``loop`` (the server's event loop); ``run`` starts reading."""
        self._loop = loop
        self._attached.set()

    def shutdown(self) -> None:
        """Stop the engine loop; ``run`` returns once it has ended."""
        self._attached.set()
        self.client.shutdown()

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        """Give the engine the tokenizer of structured outputs and stop strings (before
        any request)."""
        self.client.set_vocabulary(vocabulary)

    # ---------------------------------------------------------------- requests
    def add_request(self, core_requests: list[EngineCoreRequest], arrival_ts: float,
                    request_id: str = "") -> RequestStream:
        """Admit an API request and open its stream.

        ``core_requests`` holds one engine request per choice, for every prompt, in the
        order of the API's choice indices. ``request_id`` names the API request in the
        request log and the server's log.
        """
        self._admit(core_requests)
        for r in core_requests:
            if r.req_id in self._streams:
                raise ValueError(f"request id {r.req_id!r} is already in use")
        stream = RequestStream(self, open_choices(core_requests, self.tokenizer, arrival_ts),
                               request_id)
        if self.request_log is not None:
            self.request_log.started(request_id, stream.choices_in_order,
                                     [r.prompt_token_ids for r in core_requests])
        self._pending_requests += len(core_requests)
        self._pending_tokens += sum(len(r.prompt_token_ids) for r in core_requests)
        for r in core_requests:
            self._streams[r.req_id] = stream
            self.client.add_request(r)
        return stream

    def _admit(self, core_requests: list[EngineCoreRequest]) -> None:
        waiting = self._queue_stats.num_waiting
        waiting_tokens = self._queue_stats.num_tokens_waiting_raw
        cap = self.max_num_queued_requests
        if cap is not None and waiting + self._pending_requests + len(core_requests) > cap:
            raise AdmissionRejected(f"the server's queue is full ({cap} waiting requests)",
                                    "max_num_queued_requests")
        cap = self.max_num_queued_tokens
        tokens = sum(len(r.prompt_token_ids) for r in core_requests)
        if cap is not None and waiting_tokens + self._pending_tokens + tokens > cap:
            raise AdmissionRejected(f"the server's queue is full ({cap} waiting tokens)",
                                    "max_num_queued_tokens")

    def stream_opened(self, stream: RequestStream) -> None:
        self._open_streams.add(stream)

    def stream_closed(self, stream: RequestStream) -> None:
        self._open_streams.discard(stream)

    @property
    def num_in_flight(self) -> int:
        """API requests whose responses have not ended yet."""
        return len(self._open_streams)

    def abort_all(self) -> None:
        """Abort every request in flight; their readers still get the final deltas."""
        for stream in list(self._open_streams):
            stream.abort()

    def abort_choices(self, req_ids: list[str], reason: FinishReason) -> None:
        if req_ids:
            self.client.abort_requests(req_ids, reason)

    def on_choice_finished(self, choice: ChoiceState, stats: RequestStats | None) -> None:
        if stats is not None:
            for sink in self.finished_sinks:
                sink.record_finished(stats)
            if self.request_log is not None:
                self.request_log.finished(choice, stats)

    # --------------------------------------------------------------- receiver
    def run(self) -> None:
        """Hand every ``StepReport`` to the event loop until the engine loop ends; blocks.
        Starts reading once ``attach`` gave it a loop."""
        self._attached.wait()
        while (result := self.client.get_output()) is not None:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, result)
        self.alive = False

    def _dispatch(self, result: StepReport | QueueState) -> None:
        if isinstance(result, QueueState):
            self._queue_stats = result.stats
            self._pending_requests -= result.taken_requests
            self._pending_tokens -= result.taken_tokens
            for sink in self.step_sinks:
                sink.record_step(result.stats, None)
            return
        if result.failed is not None:
            self.consecutive_failures = self.consecutive_failures + 1 if result.failed else 0
        outputs = result.outputs
        self._queue_stats = outputs.scheduler_stats
        for sink in self.step_sinks:
            sink.record_step(outputs.scheduler_stats, outputs.iteration_stats)
        for out in outputs.outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.req_id]
                if out.finish_reason is FinishReason.ERROR:
                    stream.error = out.error or result.error
            stream._on_output(out)
