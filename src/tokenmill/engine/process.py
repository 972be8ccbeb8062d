"""The engine process: its entry point, and the core's step loop at the far end of a pipe.

    HTTP process (event loop)                        engine process
    -------------------------                        --------------
    AsyncEngine --EngineCoreRequest / Abort / None-->  reader thread -> inbox
                --Vocabulary (once, at start) ----->
                <------- QueueState, StepReport ----   run_engine_loop: drain inbox,
                                                      core.step(), publish

(the records: ``messages``). ``start_engine_process`` is what the HTTP side calls; it
spawns a fresh interpreter whose entry (``_engine_process_main``) is the first code to
import the builder, and with it torch and the kernels: this module imports neither.

Why a process: the step loop runs Python between its kernels, and the server's event
loop (HTTP, JSON, SSE, detokenisation) is Python too. Sharing one interpreter, each waits
for the other's GIL; when the cores are shared with other programs, every such wait also
puts the compute threads to sleep, and waking them costs a scheduler time slice. In its
own process the step loop never waits for the server's Python.

Invariants: ``None`` on the pipe stops the loop, which then closes its end (the reader
of results sees ``EOFError``). Each step sends a ``QueueState`` as soon as it has
scheduled, then its ``StepReport``. A ``QueueState`` says how many requests (and prompt
tokens) the core took from the inbox since the previous one and the scheduler's gauges
now, so the sender's admission control counts the queue as the core sees it, and its
gauges (and a Ray replica's reported token load) show a step's new requests and KV
blocks, one message behind at most, even during a long step. When the core goes idle
the loop publishes one more result, so gauges read zero as soon as the last request
ends. While the only requests left wait for their grammars to compile (structured
outputs), the loop does not step: it sleeps until a compilation ends or a message comes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from tokenmill.config import EngineConfig
from tokenmill.core.engine_core import EngineCore, StepFailed
from tokenmill.core.records import FinishReason
from tokenmill.core.types import EngineCoreOutputs
from tokenmill.engine.cpu_share import ThreadShare
from tokenmill.engine.messages import Abort, EngineInfo, QueueState, StepReport
from tokenmill.structured.compiler import Vocabulary

logger = logging.getLogger("tokenmill")

STARTUP_TIMEOUT_S = 600.0


class _Inbox:
    """Messages from the pipe, read on their own thread so a sender never waits for a step."""

    def __init__(self, conn: Connection) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        threading.Thread(target=self._read, args=(conn,), name="tokenmill-inbox",
                         daemon=True).start()

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                item = None  # the sender is gone: stop
            self.items.put(item)
            self.wakeup.set()
            if item is None:
                return


def run_engine_loop(core: EngineCore, conn: Connection,
                    threads: ThreadShare | None = None) -> None:
    """Step ``core`` for the requests arriving on ``conn`` until ``None`` arrives; publish
    a ``StepReport`` per step. A failed step fails only its requests (``StepFailed``); any
    other exception leaves the core's state in doubt, so every request in flight ends
    with an error. Either way the loop goes on. ``threads``, when given, times each step
    to fit the compute threads to the CPU time the engine gets."""
    stepping = contextlib.nullcontext if threads is None else threads.stepping
    inbox = _Inbox(conn)
    taken_requests = taken_tokens = 0
    idle_published = True

    def publish(outputs: EngineCoreOutputs, error: str | None = None,
                idle: bool = False) -> None:
        conn.send(StepReport(outputs, error, None if idle else error is not None))

    def publish_queue() -> None:
        nonlocal taken_requests, taken_tokens
        conn.send(QueueState(taken_requests, taken_tokens, core.scheduler_stats()))
        taken_requests = taken_tokens = 0

    core.on_scheduled = publish_queue
    core.grammars.on_compiled = inbox.wakeup.set

    try:
        while True:
            try:
                while not inbox.items.empty():
                    item = inbox.items.get_nowait()
                    if item is None:
                        return
                    if isinstance(item, Abort):
                        core.abort_requests(item.req_ids, item.reason)
                    elif isinstance(item, Vocabulary):
                        core.set_vocabulary(item)
                    else:
                        core.add_request(item)
                        taken_requests += 1
                        taken_tokens += len(item.prompt_token_ids)
                if not core.has_work():
                    if not idle_published:
                        publish(core.step(), idle=True)
                        core.check_integrity()
                        idle_published = True
                    inbox.wakeup.wait(timeout=1.0)
                    inbox.wakeup.clear()
                    continue
                if not core.can_step():  # only grammars compiling: wait for one, or a message
                    inbox.wakeup.wait(timeout=0.05)
                    inbox.wakeup.clear()
                    continue
                idle_published = False
                with stepping():
                    outputs = core.step()
                publish(outputs)
            except StepFailed as failed:
                logger.error("engine step failed; its %d request(s) end with an error",
                             len(failed.outputs.outputs), exc_info=failed.__cause__)
                publish(failed.outputs, f"engine error: {failed}")
            except Exception as error:  # noqa: BLE001 - the loop must survive to report it
                logger.exception("engine step failed")
                core.abort_all(FinishReason.ERROR)
                publish(core.step(), f"engine error: {error}")
    finally:
        conn.close()


def start_engine_process(config: EngineConfig, log_level: int = logging.INFO,
                         setup: Callable[[], None] | None = None,
                         ) -> tuple[Connection, EngineInfo, multiprocessing.Process]:
    """Build the engine in a new process (logging at ``log_level``) and start its loop there.
    ``setup``, a module-level function (it is pickled), runs first in that process: a
    profiler's hook to instrument the engine.

    Returns the server's end of the pipe, the engine's ``EngineInfo`` and the process.
    Raises ``ValueError`` with the engine's own message when it cannot be built (a bad
    option, a model that does not load), as building it here would.
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
        raise RuntimeError(f"the engine process exited with status {process.exitcode}") from None
    if isinstance(ready, BaseException):
        process.join()
        raise ready
    return server_end, ready, process


def _engine_process_main(config: EngineConfig, conn: Connection, log_level: int,
                         setup: Callable[[], None] | None) -> None:
    import torch

    from tokenmill.engine.builder import build_engine

    if setup is not None:
        setup()
    # The server coordinates shutdown; a terminal's Ctrl-C reaches the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        engine = build_engine(config)
    except ValueError as error:  # bad options or model: the server reports it and exits
        conn.send(ValueError(str(error)))
        conn.close()
        return
    conn.send(engine.info)
    follows = engine.device.type == "cpu" and config.num_threads is None
    threads = ThreadShare(torch.get_num_threads(), torch.set_num_threads) if follows else None
    run_engine_loop(engine.core, conn, threads)
