"""The engine in its own process, and the server's client of it over a pipe.

    HTTP process                                     engine process
    ------------                                     --------------
    ProcessClient --EngineCoreRequest / Abort / None-->  reader thread -> StepLoop.put
                  --Vocabulary (once, at start) ----->
                  <------- QueueState, StepReport ----   StepLoop (``loop``): the core's
                  <------- EngineInfo (once, at start)     steps, its reports sent back

(the records: ``messages``). ``ProcessClient.start`` spawns a fresh interpreter whose
entry (``_engine_process_main``) is the first code to import the builder, and with it
torch and the kernels: this module imports neither.

Why a process: the step loop runs Python between its kernels, and the server's event
loop (HTTP, JSON, SSE, detokenisation) is Python too. Sharing one interpreter, each waits
for the other's GIL; when the cores are shared with other programs, every such wait also
puts the compute threads to sleep, and waking them costs a scheduler time slice. In its
own process the step loop never waits for the server's Python.

Invariants: ``None`` on the pipe stops the loop, which then closes its end (the client's
``get_output`` then returns None). A message reaches the core before its next step.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from tokenmill.config import EngineConfig
from tokenmill.core.records import FinishReason
from tokenmill.core.request import EngineCoreRequest
from tokenmill.engine.cpu_share import ThreadShare
from tokenmill.engine.loop import Message, Outbox, Report, StepLoop
from tokenmill.engine.messages import Abort, EngineInfo
from tokenmill.structured.compiler import Vocabulary

STARTUP_TIMEOUT_S = 600.0


class ProcessClient:
    """The server's end of the engine process's pipe (an ``EngineClient``). Any thread
    may send; one thread reads (``get_output``)."""

    def __init__(self, conn: Connection, info: EngineInfo,
                 process: multiprocessing.Process) -> None:
        self.info = info
        self.process = process
        self._conn = conn
        self._send_lock = threading.Lock()

    @classmethod
    def start(cls, config: EngineConfig, log_level: int = logging.INFO,
              setup: Callable[[], None] | None = None) -> ProcessClient:
        """Build the engine in a new process (logging at ``log_level``) and start its loop
        there. ``setup``, a module-level function (it is pickled), runs first in that
        process: a profiler's hook to instrument the engine.

        Raises ``ValueError`` with the engine's own message when it cannot be built (a
        bad option, a model that does not load), as building it here would.
        """
        context = multiprocessing.get_context("spawn")  # no copy of this process's threads
        server_end, engine_end = context.Pipe()
        process = context.Process(target=_engine_process_main,
                                  args=(config, engine_end, log_level, setup),
                                  name="tokenmill-engine", daemon=True)
        process.start()
        engine_end.close()
        if not server_end.poll(STARTUP_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"the engine did not start in {STARTUP_TIMEOUT_S:.0f} s")
        try:
            ready = server_end.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the engine process exited with status {process.exitcode}") from None
        if isinstance(ready, BaseException):
            process.join()
            raise ready
        return cls(server_end, ready, process)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, req_ids: list[str], reason: FinishReason) -> None:
        self._send(Abort(req_ids, reason))

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        self._send(vocabulary)

    def shutdown(self) -> None:
        self._send(None)

    def get_output(self) -> Report | None:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _send(self, message: Message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                pass  # the engine loop is gone; ``get_output`` has seen or will see it end


def _read(conn: Connection, loop: StepLoop) -> None:
    """Hand the loop every message from the pipe, on a thread of its own so a sender
    never waits for a step; a closed pipe stops the loop."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None  # the sender is gone: stop
        loop.put(message)
        if message is None:
            return


def _engine_process_main(config: EngineConfig, conn: Connection, log_level: int,
                         setup: Callable[[], None] | None) -> None:
    import torch

    from tokenmill.engine.builder import build_core

    if setup is not None:
        setup()
    # The server coordinates shutdown; a terminal's Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    outbox = Outbox(conn.send)
    try:
        built = build_core(config, on_scheduled=outbox.queue_state)
    except ValueError as error:  # bad options or model: the server reports it and exits
        conn.send(ValueError(str(error)))
        conn.close()
        return
    conn.send(built.info)
    follows = built.device.type == "cpu" and config.num_threads is None
    threads = ThreadShare(torch.get_num_threads(), torch.set_num_threads) if follows else None
    loop = StepLoop(built.core, outbox, threads)
    threading.Thread(target=_read, args=(conn, loop), name="tokenmill-inbox",
                     daemon=True).start()
    try:
        loop.run()
    finally:
        conn.close()
