"""``tokenmill serve``: start the engine process, then serve until SIGINT/SIGTERM.

The engine builds the model and steps in its own process (``engine.process``), which
ignores both signals and ends when told to or when this process goes. In this one,
uvicorn runs its event loop on a second thread and the main thread hands the engine's
results to it (``AsyncEngineClient.run``); the server stops when the engine loop ends. A first
signal drains the server (``ServerLifecycle.drain``: new requests get 503, those in
flight get up to ``--shutdown-timeout`` seconds, then are aborted with their usage) and
then stops it; a second one stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.process import ProcessClient
from tokenmill.frontend.async_client import AsyncEngineClient
from tokenmill.server.app import build_server


def serve(server_config: ServerConfig, config: EngineConfig,
          engine_setup: Callable[[], None] | None = None) -> int:
    """Serve until stopped; the exit status (0, or 1 when the server never started).
    Both processes log at the root logger's level; ``engine_setup`` runs first in the
    engine process (``ProcessClient.start``'s ``setup``)."""
    log_level = logging.getLogger().level
    client = ProcessClient.start(config, log_level, engine_setup)
    engine, app, lifecycle = build_server(server_config, config, client)
    server = uvicorn.Server(uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                           log_level=log_level, timeout_graceful_shutdown=5))
    http_thread = threading.Thread(target=_serve_http, args=(server, engine),
                                   name="tokenmill-http")

    def exit_server() -> None:
        server.should_exit = True

    def stop(signum: int, _frame) -> None:
        if lifecycle.start_drain(then=exit_server):
            return
        if server.should_exit or lifecycle.draining:  # a second signal: stop at once
            server.force_exit = True
        server.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    http_thread.start()
    engine.run()  # until the engine loop ends (shut down, or the process died)
    exit_server()
    http_thread.join()
    client.process.join(timeout=30)
    return 0 if server.started else 1


def _serve_http(server: uvicorn.Server, engine: AsyncEngineClient) -> None:
    """uvicorn's loop, off the main thread; when it ends (or fails to start), so does the engine."""
    try:
        server.run()
    finally:
        engine.shutdown()
