"""The FastAPI application: routes and metrics exposition, behind ``RequestGate``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.frontend.async_engine import AsyncEngine
from tokenmill.frontend.processor import InputProcessor
from tokenmill.metrics.history import EngineHistory
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.server.errors import APIError, error_response, install_error_handlers
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.middleware import RequestGate
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.serving import OpenAIServing, ServerOptions
from tokenmill.server.ui import install_ui

logger = logging.getLogger("tokenmill")


def build_app(engine: AsyncEngine, processor: InputProcessor, metrics: PrometheusMetrics,
              options: ServerOptions, max_model_len: int,
              stat_logger: StatLogger | None = None,
              lifecycle: ServerLifecycle | None = None,
              history: EngineHistory | None = None,
              engine_limits: dict[str, int] | None = None) -> FastAPI:
    """``history`` (and the engine's request log) feed the dashboard, None when stats are
    off; ``engine_limits`` are the engine's sizes it shows (``ui.install_ui``)."""
    serving = OpenAIServing(engine, processor, metrics, options)
    lifecycle = lifecycle or ServerLifecycle(engine, shutdown_timeout=0.0)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.attach(asyncio.get_running_loop())
        lifecycle.attach(asyncio.get_running_loop())
        ticker = asyncio.create_task(_log_periodically(stat_logger)) if stat_logger else None
        try:
            yield
        finally:
            if ticker:
                ticker.cancel()
            engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestGate, limits=options.limits, api_keys=options.api_keys,
                       lifecycle=lifecycle)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if lifecycle.healthy() else 503)

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
        return await serving.completions(body, request.state.request_id, request.receive)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request.state.request_id, request.receive)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = engine.tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt)
        else:
            tokens = engine.tokenizer.encode(body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        tokens = processor.check_token_ids(body.tokens, "tokens")
        return {"prompt": engine.tokenizer.decode(tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    install_ui(app, options.served_model_name, engine_limits or {}, history,
               engine.request_log)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc))

    return app


async def _log_periodically(stat_logger: StatLogger) -> None:
    while True:
        await asyncio.sleep(1.0)
        stat_logger.maybe_log(time.monotonic())
