"""The FastAPI application: routes and metrics exposition, behind ``RequestGate``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.client import EngineClient
from tokenmill.frontend.async_client import AsyncEngineClient
from tokenmill.frontend.processor import InputProcessor
from tokenmill.frontend.request_log import RequestLog
from tokenmill.metrics.history import EngineHistory
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.sampling_params import PoolingParams
from tokenmill.server.anthropic import MessagesServing
from tokenmill.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.embeddings import EmbeddingRequest, EmbeddingServing
from tokenmill.server.errors import APIError, error_response_for, install_error_handlers
from tokenmill.server.lifecycle import ServerLifecycle
from tokenmill.server.middleware import RequestGate
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.server.responses import ResponsesServing
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving import OpenAIServing
from tokenmill.server.ui import install_ui
from tokenmill.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill")

EngineHandler = Callable[[Any, str, Callable], Awaitable[Any]]


def _engine_route(body_model: type, handle: EngineHandler) -> Callable:
    """A POST route that parses its body as ``body_model`` and hands it to ``handle`` with
    the request's id and its ``receive`` (to notice a client that leaves). The signature
    is set, not annotated, since the body's type is a value here."""

    async def route(body, request: Request):
        return await handle(body, request.state.request_id, request.receive)

    route.__signature__ = inspect.Signature([
        inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=body_model),
        inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)])
    return route


def build_server(server_config: ServerConfig, config: EngineConfig, client: EngineClient,
                 extra_step_sinks: Sequence = ()
                 ) -> tuple[AsyncEngineClient, FastAPI, ServerLifecycle]:
    """The server's engine client, the app and its lifecycle for ``server_config``, around
    the engine behind ``client`` (in a server, ``engine.process``), which ``config`` built.

    One code path for a single server and for every Ray Serve replica; ``extra_step_sinks``
    also receive each step's ``SchedulerStats`` (a replica reports its token load with them),
    even with ``--disable-log-stats``.
    """
    tokenizer = load_tokenizer(config.model)
    info = client.info
    processor = InputProcessor(tokenizer, info)
    server_config = dataclasses.replace(
        server_config, served_model_name=server_config.served_model_name or info.model_name)
    name = server_config.served_model_name
    metrics = PrometheusMetrics(name, vllm_names=server_config.metrics_vllm_names,
                                engine_pid=info.pid)
    stats = server_config.stats
    stat_logger = StatLogger(name, server_config.log_stats_interval,
                             speculative=config.speculative_ngram > 0) if stats else None
    history = EngineHistory() if stats else None
    request_log = RequestLog(tokenizer, keep_text=server_config.ui_show_text) if stats else None
    step_sinks = [metrics, stat_logger, history] if stats else []
    finished_sinks = [metrics, history] if stats else []
    engine = AsyncEngineClient(client, tokenizer, [*step_sinks, *extra_step_sinks],
                               finished_sinks, config.max_num_queued_requests,
                               config.max_num_queued_tokens, request_log)
    engine.set_vocabulary(processor.vocabulary())
    lifecycle = ServerLifecycle(engine, server_config.shutdown_timeout)
    engine_limits = {"max_num_seqs": config.max_num_seqs,
                     "max_num_batched_tokens": config.max_num_batched_tokens,
                     "max_model_len": info.max_model_len,
                     "kv_cache_tokens_total": info.kv_cache_tokens}
    app = build_app(engine, processor, metrics, server_config, stat_logger, lifecycle, history,
                    engine_limits)
    return engine, app, lifecycle


def build_app(engine: AsyncEngineClient, processor: InputProcessor, metrics: PrometheusMetrics,
              server_config: ServerConfig, stat_logger: StatLogger | None = None,
              lifecycle: ServerLifecycle | None = None,
              history: EngineHistory | None = None,
              engine_limits: dict[str, int] | None = None) -> FastAPI:
    """``server_config.served_model_name`` is set; ``history`` (and the engine's request log)
    feed the dashboard, None when stats are off; ``engine_limits`` are the engine's sizes
    it shows (``ui.install_ui``)."""
    max_model_len = processor.max_model_len
    serving = OpenAIServing(engine, processor, metrics, server_config)
    responses_serving = ResponsesServing(serving, server_config.served_model_name)
    messages_serving = MessagesServing(serving, server_config.served_model_name)
    embedding_serving = EmbeddingServing(serving, PoolingParams(
        server_config.embedding_pooling, server_config.embedding_normalize))
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
    app.add_middleware(RequestGate, limits=server_config.limits, api_keys=server_config.api_keys,
                       lifecycle=lifecycle)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the server takes requests; 503 while it drains, and after repeated
        failed engine steps (an orchestrator should then restart it)."""
        status = ("ok" if lifecycle.healthy() else
                  "draining" if lifecycle.draining else "failing")
        return JSONResponse({"status": status, "model": server_config.served_model_name,
                             "engine_alive": engine.alive},
                            status_code=200 if status == "ok" else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": server_config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tokenmill", "max_model_len": max_model_len}]}

    for path, body_model, handle in (
            ("/v1/completions", CompletionRequest, serving.completions),
            ("/v1/chat/completions", ChatCompletionRequest, serving.chat),
            ("/v1/embeddings", EmbeddingRequest, embedding_serving.create),
            ("/v1/responses", ResponsesRequest, responses_serving.create),
            ("/v1/messages", MessagesRequest, messages_serving.create)):
        app.add_api_route(path, _engine_route(body_model, handle), methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        return await messages_serving.count_tokens(body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            tokens = engine.tokenizer.apply_chat_template(
                [m.template_dict() for m in body.messages],
                add_generation_prompt=body.add_generation_prompt, tools=tools or None)
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

    install_ui(app, server_config.served_model_name, engine_limits or {}, history,
               engine.request_log)

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response_for(request.url.path, 400, str(exc))

    return app


async def _log_periodically(stat_logger: StatLogger) -> None:
    while True:
        await asyncio.sleep(1.0)
        stat_logger.maybe_log(time.monotonic())
