"""How the server and the offline ``LLM`` drive the engine: one client interface, two
implementations, one step loop (``loop.StepLoop``) behind both.

    EngineClient        where the step loop runs
    ProcessClient       in the engine process, across a pipe (``process``): the server
    InprocClient        in the thread that calls ``get_output`` (``inproc``): the offline
                        ``LLM``, and tests that serve an engine built in their own process

Standard library and the core's records only: the HTTP side imports this module.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.core.records import FinishReason
from tokenmill.core.request import EngineCoreRequest
from tokenmill.engine.messages import EngineInfo, QueueState, StepReport
from tokenmill.structured.compiler import Vocabulary


class EngineClient(Protocol):
    """Messages take effect in the order they were sent, each before the engine's next
    step. Any thread may send; one thread calls ``get_output``."""

    info: EngineInfo  # what the engine told its client about itself

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, req_ids: list[str], reason: FinishReason) -> None:
        """Finish the requests now; their final outputs come with the next step."""

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        """The tokenizer of structured outputs and stop strings (before any request)."""

    def get_output(self) -> QueueState | StepReport | None:
        """The engine's next report, blocking until there is one; None once the engine
        has stopped (``shutdown``, or its process died)."""

    def shutdown(self) -> None:
        """Stop the step loop; ``get_output`` then returns None."""
