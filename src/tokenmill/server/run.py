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
from tokenmill.frontend.request_log import RequestLog
from tokenmill.metrics.history import EngineHistory
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.serving import ServerOptions


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    engine = build_engine(config)
    name = args.served_model_name or engine.model_name
    metrics = PrometheusMetrics(name, vllm_names=args.metrics_vllm_names)
    stats = not args.disable_log_stats
    stat_logger = StatLogger(name, args.log_stats_interval) if stats else None
    history = EngineHistory() if stats else None
    request_log = RequestLog(engine.tokenizer, keep_text=args.ui_show_text) if stats else None
    step_sinks = [metrics, stat_logger, history] if stats else []
    finished_sinks = [metrics, history] if stats else []
    async_engine = AsyncEngine(engine.core, engine.tokenizer, step_sinks, finished_sinks,
                               config.max_num_queued_requests, config.max_num_queued_tokens,
                               request_log)
    options = ServerOptions(name, args.default_continuous_usage_stats, args.api_key)
    app = build_app(async_engine, engine.processor, metrics, options, engine.max_model_len,
                    stat_logger, history)
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
