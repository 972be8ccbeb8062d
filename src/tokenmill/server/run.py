"""``tokenmill serve``: build the engine, then serve until SIGINT/SIGTERM.

The engine steps on the main thread, which loaded the model; uvicorn runs its event loop
on a second thread. A first signal stops accepting requests and lets those in flight
finish (up to 5 s), a second one stops at once.
"""

from __future__ import annotations

import argparse
import signal
import threading

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.builder import build_engine
from tokenmill.server.app import build_server


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    async_engine, app = build_server(args, build_engine(config))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    http_thread = threading.Thread(target=_serve_http, args=(server, async_engine),
                                   name="tokenmill-http")

    def stop(signum: int, _frame) -> None:
        if server.should_exit:  # a second signal: stop without waiting for requests
            server.force_exit = True
        server.should_exit = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    http_thread.start()
    async_engine.run()  # on this thread, which loaded the model (see AsyncEngine)
    http_thread.join()
    return 0 if server.started else 1


def _serve_http(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """uvicorn's loop, off the main thread; when it ends (or fails to start), so does the engine."""
    try:
        server.run()
    finally:
        engine.shutdown()
