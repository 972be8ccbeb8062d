"""``tokenmill serve``: build the engine, then run the app under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.builder import build_engine
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.app import build_app
from tokenmill.server.serving import ServerOptions


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    engine = build_engine(config)
    name = args.served_model_name or engine.model_name
    metrics = PrometheusMetrics(name, vllm_names=args.metrics_vllm_names)
    stat_logger = None if args.disable_log_stats else StatLogger(name, args.log_stats_interval)
    step_sinks = [] if args.disable_log_stats else [metrics, stat_logger]
    finished_sinks = [] if args.disable_log_stats else [metrics]
    async_engine = AsyncEngine(engine.core, engine.tokenizer, step_sinks, finished_sinks,
                               config.max_num_queued_requests, config.max_num_queued_tokens)
    options = ServerOptions(name, args.default_continuous_usage_stats, args.api_key)
    app = build_app(async_engine, engine.processor, metrics, options, engine.max_model_len,
                    stat_logger)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
