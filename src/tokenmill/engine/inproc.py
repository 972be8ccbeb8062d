"""The engine in the caller's process: an ``EngineClient`` whose step loop turns in the
thread that calls ``get_output``.

It builds the engine itself, so it loads torch and the model: the offline ``LLM`` uses
it, and so can a test that serves an engine it holds (its ``core`` is there to inspect).
The engine steps only while ``get_output`` runs; with nothing in flight, that call
sleeps until a message comes from another thread.
"""

from __future__ import annotations

from collections import deque

from tokenmill.config import EngineConfig
from tokenmill.core.records import FinishReason
from tokenmill.core.request import EngineCoreRequest
from tokenmill.engine.builder import build_core
from tokenmill.engine.loop import Outbox, Report, StepLoop
from tokenmill.engine.messages import Abort
from tokenmill.structured.compiler import Vocabulary


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self._reports: deque[Report] = deque()
        outbox = Outbox(self._reports.append)
        built = build_core(config, on_scheduled=outbox.queue_state)
        self.core = built.core
        self.info = built.info
        self._loop = StepLoop(built.core, outbox)
        self._stopped = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self._loop.put(request)

    def abort_requests(self, req_ids: list[str], reason: FinishReason) -> None:
        self._loop.put(Abort(req_ids, reason))

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        self._loop.put(vocabulary)

    def shutdown(self) -> None:
        self._loop.put(None)

    def get_output(self) -> Report | None:
        while not self._reports:
            if self._stopped or not self._loop.turn():
                self._stopped = True
                return None
        return self._reports.popleft()
