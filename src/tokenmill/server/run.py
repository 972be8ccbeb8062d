"""``tokenmill serve``: start the engine process, then serve until SIGINT/SIGTERM.

The engine builds the model and steps in its own process (``engine_loop``), which
ignores both signals and ends when told to or when this process goes. In this one,
uvicorn runs its event loop on a second thread and the main thread hands the engine's
results to it (``AsyncEngine.run``); the server stops when the engine loop ends. A first
signal drains the server (``ServerLifecycle.drain``: new requests get 503, those in
flight get up to ``--shutdown-timeout`` seconds, then are aborted with their usage) and
then stops it; a second one stops at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.engine_loop import start_engine_process
from tokenmill.frontend.processor import InputProcessor
from tokenmill.frontend.request_log import RequestLog
from tokenmill.metrics.history import EngineHistory
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.limits import RequestLimits
from tokenmill.server.serving import ServerOptions
from tokenmill.tokenizer.tokenizer import load_tokenizer


def serve(args: argparse.Namespace, config: EngineConfig, api_keys: tuple[str, ...],
          limits: RequestLimits) -> int:
    conn, info, engine_process = start_engine_process(config, logging.getLogger().level)
    tokenizer = load_tokenizer(config.model)
    processor = InputProcessor(tokenizer, info.max_model_len, info.vocab_size)
    name = args.served_model_name or info.model_name
    metrics = PrometheusMetrics(name, vllm_names=args.metrics_vllm_names)
    stats = not args.disable_log_stats
    stat_logger = StatLogger(name, args.log_stats_interval,
                             speculative=config.speculative_ngram > 0) if stats else None
    history = EngineHistory() if stats else None
    request_log = RequestLog(tokenizer, keep_text=args.ui_show_text) if stats else None
    step_sinks = [metrics, stat_logger, history] if stats else []
    finished_sinks = [metrics, history] if stats else []
    async_engine = AsyncEngine(conn, tokenizer, step_sinks, finished_sinks,
                               config.max_num_queued_requests, config.max_num_queued_tokens,
                               request_log)
    options = ServerOptions(name, args.default_continuous_usage_stats, api_keys, limits)
    lifecycle = ServerLifecycle(async_engine, args.shutdown_timeout)
    engine_limits = {"max_num_seqs": config.max_num_seqs,
                     "max_num_batched_tokens": config.max_num_batched_tokens,
                     "max_model_len": info.max_model_len,
                     "kv_cache_tokens_total": info.num_kv_blocks * config.block_size}
    app = build_app(async_engine, processor, metrics, options, info.max_model_len,
                    stat_logger, lifecycle, history, engine_limits)
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
    async_engine.run()  # until the engine loop ends (shut down, or the process died)
    exit_server()
    http_thread.join()
    engine_process.join(timeout=30)
    return 0 if server.started else 1


def _serve_http(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """uvicorn's loop, off the main thread; when it ends (or fails to start), so does the engine."""
    try:
        server.run()
    finally:
        engine.shutdown()
