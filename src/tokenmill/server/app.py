"""The FastAPI application: routes, API-key check, request ids, metrics exposition."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.builder import Engine
from tokenmill.frontend.processor import InputProcessor
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.errors import APIError, error_response, install_error_handlers
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.serving import OpenAIServing, ServerOptions, new_request_id

logger = logging.getLogger("tokenmill")


def build_server(args: argparse.Namespace, engine: Engine,
                 extra_step_sinks: Sequence = ()) -> tuple[AsyncEngine, FastAPI]:
    """The engine client and the app for ``tokenmill serve``'s options, around a built engine.

    One code path for a single server and for every Ray Serve replica; ``extra_step_sinks``
    also receive each step's ``SchedulerStats`` (a replica reports its token load with them),
    even with ``--disable-log-stats``.
    """
    name = args.served_model_name or engine.model_name
    metrics = PrometheusMetrics(name, vllm_names=args.metrics_vllm_names)
    stat_logger = None if args.disable_log_stats else StatLogger(name, args.log_stats_interval)
    step_sinks = [] if args.disable_log_stats else [metrics, stat_logger]
    finished_sinks = [] if args.disable_log_stats else [metrics]
    config = engine.config
    async_engine = AsyncEngine(engine.core, engine.tokenizer, [*step_sinks, *extra_step_sinks],
                               finished_sinks, config.max_num_queued_requests,
                               config.max_num_queued_tokens)
    options = ServerOptions(name, args.default_continuous_usage_stats, args.api_key)
    app = build_app(async_engine, engine.processor, metrics, options, engine.max_model_len,
                    stat_logger)
    return async_engine, app


def build_app(engine: AsyncEngine, processor: InputProcessor, metrics: PrometheusMetrics,
              options: ServerOptions, max_model_len: int,
              stat_logger: StatLogger | None = None) -> FastAPI:
    serving = OpenAIServing(engine, processor, metrics, options)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.attach(asyncio.get_running_loop())
        ticker = asyncio.create_task(_log_periodically(stat_logger)) if stat_logger else None
        try:
            yield
        finally:
            if ticker:
                ticker.cancel()
            engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    install_error_handlers(app)

    @app.middleware("http")
    async def request_context(request: Request, call_next):
        if options.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {options.api_key}":
                return error_response(401, "invalid or missing API key", None, "invalid_api_key")
        request_id = request.headers.get("x-request-id") or new_request_id()
        request.state.request_id = request_id
        response = await call_next(request)
        response.headers["x-request-id"] = request_id
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": options.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tokenmill", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request.state.request_id)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request.state.request_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = engine.tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in body.messages])
        else:
            tokens = engine.tokenizer.encode(body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving._check_model(body.model)
        processor.tokenize(body.tokens)  # vocabulary check
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    return app



async def _log_periodically(stat_logger: StatLogger) -> None:
    while True:
        await asyncio.sleep(1.0)
        stat_logger.maybe_log(time.monotonic())
