"""The one step loop: messages in, ``core.step()``, reports out. Both engine clients run
it: the engine process for the server (``process``), the caller's thread for the offline
``LLM`` (``inproc``).

    messages (``put``, any thread)          reports (``Outbox``)
    EngineCoreRequest / Abort / Vocabulary  QueueState once a step has scheduled
    None: stop                              StepReport once it is done

Invariants: messages take effect in the order they were put, each before the next step.
A ``QueueState`` says how many requests (and prompt tokens) the core took since the
previous one, and the scheduler's gauges, so a client's admission control counts the
queue as the core sees it, one message behind at most, even during a long step. When
the core goes idle the loop publishes one more report, so gauges read zero as soon as
the last request ends. It never spins: with nothing to step, or only requests whose
grammars are compiling, it sleeps until a message comes, a compilation ends or a
compile deadline passes (``EngineCore.wait``). A failed step fails only its requests
(``StepFailed``); any other exception leaves the core's state in doubt, so every
request in flight ends with an error. Either way the loop goes on.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable

from tokenmill.core.engine_core import EngineCore, StepFailed
from tokenmill.core.records import FinishReason, SchedulerStats
from tokenmill.core.request import EngineCoreRequest
from tokenmill.core.types import EngineCoreOutputs
from tokenmill.engine.cpu_share import ThreadShare
from tokenmill.engine.messages import Abort, QueueState, StepReport
from tokenmill.structured.compiler import Vocabulary

logger = logging.getLogger("tokenmill")

Message = EngineCoreRequest | Abort | Vocabulary | None
Report = QueueState | StepReport


class Outbox:
    """Where a step loop's reports go (``send``). Its ``queue_state`` is the core's
    ``on_scheduled`` hook, so build the core with it."""

    def __init__(self, send: Callable[[Report], None]) -> None:
        self._send = send
        self._taken_requests = 0
        self._taken_tokens = 0

    def took(self, request: EngineCoreRequest) -> None:
        """The core took ``request``: the next ``QueueState`` counts it."""
        self._taken_requests += 1
        self._taken_tokens += len(request.prompt_token_ids)

    def queue_state(self, stats: SchedulerStats) -> None:
        self._send(QueueState(self._taken_requests, self._taken_tokens, stats))
        self._taken_requests = self._taken_tokens = 0

    def step_report(self, outputs: EngineCoreOutputs, error: str | None = None,
                    idle: bool = False) -> None:
        self._send(StepReport(outputs, error, None if idle else error is not None))


class StepLoop:
    """The step loop of ``core``, whose ``on_scheduled`` is ``outbox.queue_state``.
    ``threads``, when given, times each step to fit the compute threads to the CPU time
    the engine gets."""

    def __init__(self, core: EngineCore, outbox: Outbox,
                 threads: ThreadShare | None = None) -> None:
        self.core = core
        self.outbox = outbox
        self._stepping = contextlib.nullcontext if threads is None else threads.stepping
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._idle_published = True

    def put(self, message: Message) -> None:
        """Hand the loop a message (thread-safe); it takes effect before the next step."""
        self._inbox.put(message)
        self.core.wake()

    def run(self) -> None:
        """Turn until ``None`` arrives."""
        while self.turn():
            pass

    def turn(self) -> bool:
        """Take the messages that arrived, then step once, publish the idle report, or
        sleep until something can change. False once ``None`` has arrived."""
        core = self.core
        try:
            if not self._take_messages():
                return False
            if not core.has_work():
                if self._idle_published:
                    core.wait()
                else:
                    self.outbox.step_report(core.step(), idle=True)
                    core.check_integrity()
                    self._idle_published = True
            elif not core.can_step():  # only grammars compiling
                core.wait()
            else:
                self._idle_published = False
                with self._stepping():
                    outputs = core.step()
                self.outbox.step_report(outputs)
        except StepFailed as failed:
            logger.error("engine step failed; its %d request(s) end with an error",
                         len(failed.outputs.outputs), exc_info=failed.__cause__)
            self.outbox.step_report(failed.outputs, f"engine error: {failed}")
        except Exception as error:  # noqa: BLE001 - the loop must survive to report it
            logger.exception("engine step failed")
            core.abort_all(FinishReason.ERROR)
            self.outbox.step_report(core.step(), f"engine error: {error}")
        return True

    def _take_messages(self) -> bool:
        """Apply every message waiting; False when one is ``None``."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if message is None:
                return False
            if isinstance(message, Abort):
                self.core.abort_requests(message.req_ids, message.reason)
            elif isinstance(message, Vocabulary):
                self.core.set_vocabulary(message)
            else:
                self.core.add_request(message)
                self.outbox.took(message)
