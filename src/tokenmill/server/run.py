"""``tokenmill serve``: build the engine, then serve until SIGINT/SIGTERM.

The engine steps on the main thread, which loaded the model; uvicorn runs its event loop
on a second thread. A first signal drains the server (``ServerLifecycle.drain``: new
requests get 503, those in flight get up to ``--shutdown-timeout`` seconds, then are
aborted with their usage) and then stops it; a second one stops at once.
"""

from __future__ import annotations

import argparse
import signal
import threading

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.builder import build_engine
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.limits import RequestLimits
from tokenmill.server.serving import ServerOptions


def serve(args: argparse.Namespace, config: EngineConfig, api_keys: tuple[str, ...],
          limits: RequestLimits) -> int:
    engine = build_engine(config)
    name = args.served_model_name or engine.model_name
    metrics = PrometheusMetrics(name, vllm_names=args.metrics_vllm_names)
    stat_logger = None if args.disable_log_stats else StatLogger(
        name, args.log_stats_interval, speculative=config.speculative_ngram > 0)
    step_sinks = [] if args.disable_log_stats else [metrics, stat_logger]
    finished_sinks = [] if args.disable_log_stats else [metrics]
    async_engine = AsyncEngine(engine.core, engine.tokenizer, step_sinks, finished_sinks,
                               config.max_num_queued_requests, config.max_num_queued_tokens)
    options = ServerOptions(name, args.default_continuous_usage_stats, api_keys, limits)
    lifecycle = ServerLifecycle(async_engine, args.shutdown_timeout)
    app = build_app(async_engine, engine.processor, metrics, options, engine.max_model_len,
                    stat_logger, lifecycle)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    http_thread = threading.Thread(target=_serve_http, args=(server, async_engine),
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
    async_engine.run()  # on this thread, which loaded the model (see AsyncEngine)
    http_thread.join()
    return 0 if server.started else 1


def _serve_http(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """uvicorn's loop, off the main thread; when it ends (or fails to start), so does the engine."""
    try:
        server.run()
    finally:
        engine.shutdown()
