"""The completion and chat handlers: request -> engine -> SSE stream or JSON response.

Usage accounting (SPEC section 2): per-chunk usage is cumulative for the chunk's
choice; the final usage counts each prompt once and sums completion tokens over all
choices. Every chunk of a choice carries at least one committed token, except its
finish chunk when the choice ended without one (a stop string or an abort). With tools,
a delta whose text is held back (a tool call still being written) sends no chunk; the
next chunk's usage counts its tokens.

Structured outputs and tools are checked here, before anything reaches the engine: the
constraint (``response_format``, ``structured_outputs``, ``guided_*``, or the grammar a
``tool_choice`` implies) must compile, which llguidance checks on a worker thread (a
large grammar takes milliseconds; the result is cached), or the request gets a 400
naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from tokenmill.config import ServerConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.frontend.async_client import (
    AdmissionRejected,
    AsyncEngineClient,
    RequestStream,
)
from tokenmill.frontend.outputs import ChoiceDelta
from tokenmill.frontend.processor import InputProcessor
from tokenmill.metrics.prometheus import PrometheusMetrics
from tokenmill.sampling_params import SamplingParams, StructuredOutput
from tokenmill.server.errors import APIError, error_body
from tokenmill.server.formats import ChatFormat, CompletionFormat
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, _Common
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.tools import ToolPlan, parser_for_template, plan_tools
from tokenmill.server.usage import ReasoningCount, UsageCounter
from tokenmill.structured.grammar import GrammarError, check_structured_output

logger = logging.getLogger("tokenmill")

T = TypeVar("T")


@dataclass(slots=True)
class Job:
    """One API request in flight: its prompts, stream and running totals."""

    response_id: str
    created: int
    stream: RequestStream
    params: SamplingParams
    prompt_ids: list[list[int]]
    echo_texts: list[str] | None
    usage: UsageCounter
    metrics: dict[int, dict] = field(default_factory=dict)

    def prompt_index(self, choice_index: int) -> int:
        return choice_index // self.params.n

    def record(self, delta: ChoiceDelta) -> None:
        self.usage.record(delta, self.stream.num_cached_tokens(delta.index))
        if delta.stats is not None:
            self.metrics[delta.index] = {"index": delta.index, **delta.stats.to_dict()}


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A chat request checked and rendered, ready for the engine (``OpenAIServing.plan_chat``);
    the other chat-shaped APIs (Responses, Anthropic's Messages) start from one too."""

    params: SamplingParams
    prompt_ids: list[int]
    format: ChatFormat
    reasoning: ReasoningCount | None  # a choice's reasoning tokens, with a reasoning parser


class EngineFailed(Exception):
    """The engine ended the request with an error (``chat_deltas``)."""


class OpenAIServing:
    def __init__(self, engine: AsyncEngineClient, processor: InputProcessor,
                 metrics: PrometheusMetrics, server_config: ServerConfig) -> None:
        """``server_config.served_model_name`` must be set (the engine's model name by default)."""
        self.engine = engine
        self.processor = processor
        self.metrics = metrics
        self.server_config = server_config
        self.tokenizer = engine.tokenizer
        parser = server_config.tool_call_parser
        self.tool_call_parser = (parser_for_template(self.tokenizer.chat_template)
                                 if parser == "auto" else parser)
        self.reasoning = (ReasoningParser(server_config.reasoning_parser)
                          if server_config.reasoning_parser else None)

    # ---------------------------------------------------------------- entry
    async def completions(self, body: CompletionRequest, request_id: str, receive: Receive):
        params = self._checked_params(body, "logprobs")
        await self._check_constraint(*body.structured_output())
        prompts = body.prompts()
        self.server_config.limits.check_num_prompts(len(prompts))
        prompt_ids = [self.processor.tokenize(p) for p in prompts]
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        fmt = CompletionFormat(self.tokenizer)
        return await self._serve(body, params, request_id, prompt_ids, echo, fmt, receive)

    async def chat(self, body: ChatCompletionRequest, request_id: str, receive: Receive):
        plan = await self.plan_chat(body)
        return await self._serve(body, plan.params, request_id, [plan.prompt_ids], None,
                                 plan.format, receive, plan.reasoning)

    async def plan_chat(self, body: ChatCompletionRequest) -> ChatPlan:
        """``body`` checked (a 400 naming the field otherwise) and rendered."""
        params = self._checked_params(body, "top_logprobs")
        constraint, field = body.structured_output()
        plan = self._tool_plan(body)
        if plan.constraint is not None:
            if constraint is not None:
                raise InvalidParameterError(
                    f"tool_choice {plan.mode!r} writes the output with a grammar of its own; "
                    f"it cannot be combined with {field}", "tool_choice")
            constraint, field = plan.constraint, "tools"
        ids = self.tokenizer.apply_chat_template(body.message_dicts(),
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 tools=plan.tools)
        prompt_ids = self.processor.tokenize(ids)
        reasoning = self.reasoning
        if reasoning is None:
            params.structured_output = constraint
            await self._check_constraint(constraint, field)
            return ChatPlan(params, prompt_ids, ChatFormat(self.tokenizer, plan), None)
        tail = self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        params.structured_output = reasoning.constraint(constraint, tail, field or "")
        await self._check_constraint(params.structured_output, field)
        params.skip_special_tokens = params.skip_special_tokens and reasoning.skip_special_tokens

        def decode(ids: Sequence[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

        def count(output_ids: Sequence[int]) -> int:
            return reasoning.reasoning_tokens(decode, tail, output_ids)

        fmt = ChatFormat(self.tokenizer, plan, lambda: reasoning.stream(tail))
        return ChatPlan(params, prompt_ids, fmt, count)

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        choice = body.tool_choice
        return plan_tools(
            [t.model_dump(exclude_none=True) for t in body.tools or ()],
            choice.model_dump() if choice is not None and not isinstance(choice, str) else choice,
            body.parallel_tool_calls, self.tokenizer.supports_tools, self.tool_call_parser)

    async def _check_constraint(self, constraint: StructuredOutput | None,
                                field: str | None) -> None:
        """A 400 naming ``field`` unless ``constraint`` is within the limits and compiles."""
        if constraint is None:
            return
        self.server_config.limits.check_structured_output(constraint, field or "structured_outputs")
        try:
            await asyncio.to_thread(check_structured_output, constraint)
        except GrammarError as e:
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
                    "grammar": "grammar"}[constraint.kind]
            raise InvalidParameterError(f"{field}: the {what} does not compile: {e}",
                                        field) from None

    def _checked_params(self, body: _Common, logprobs_param: str) -> SamplingParams:
        """The request's sampling settings, once the model, fields and limits are checked."""
        self.check_model(body.model)
        body.check_fields()
        params = body.to_sampling_params()
        self.server_config.limits.check_params(params, logprobs_param)
        return params

    async def _serve(self, body: _Common, params: SamplingParams, request_id: str,
                     prompt_ids: list[list[int]], echo: list[str] | None, fmt: CompletionFormat,
                     receive: Receive, reasoning: ReasoningCount | None = None):
        job = self.start(params, request_id, prompt_ids, echo, fmt, reasoning, body.priority)
        if body.stream:
            return _EngineStreamResponse(job.stream, self._sse(job, body, fmt))
        return await self.respond(job, self._collect(job, body, fmt), receive)

    def start(self, params: SamplingParams, request_id: str, prompt_ids: list[list[int]],
              echo: list[str] | None, fmt: CompletionFormat,
              reasoning: ReasoningCount | None = None, priority: int = 0) -> Job:
        """Admit the request to the engine (a 503 when the queue is full) and open its job;
        ``priority``: its scheduling priority (vLLM's request field)."""
        arrival = time.monotonic()
        # NOTE: clients choose request ids (x-request-id) and may reuse them; engine ids
        # must be unique, so the engine gets its own.
        engine_id = uuid.uuid4().hex
        logger.info("request %s: %d prompt(s), n=%d, engine id %s", request_id,
                    len(prompt_ids), params.n, engine_id)
        core_requests = []
        for i, ids in enumerate(prompt_ids):
            core_requests += self.processor.make_core_requests(f"{engine_id}-p{i}", ids, params,
                                                               priority)
        try:
            stream = self.engine.add_request(core_requests, arrival, request_id)
        except AdmissionRejected as rejected:
            self.metrics.record_rejection(rejected.reason)
            raise
        self.metrics.record_request_params(params.n, params.max_tokens)  # as the request set it
        usage = UsageCounter(prompt_ids, params.n, reasoning)
        return Job(fmt.id_prefix + request_id, int(time.time()), stream, params, prompt_ids,
                   echo, usage)

    @staticmethod
    def stream_response(job: Job, events: AsyncIterator[str]) -> StreamingResponse:
        """An SSE response of ``events`` that closes ``job``'s stream however it ends."""
        return _EngineStreamResponse(job.stream, events)

    @staticmethod
    async def respond(job: Job, body: Awaitable[dict], receive: Receive) -> Response:
        """``body`` as JSON, unless the client leaves first; ``job``'s stream is closed."""
        return await respond_json(job.stream, body, receive)

    @staticmethod
    async def chat_deltas(job: Job, fmt: ChatFormat
                          ) -> AsyncIterator[tuple[ChoiceDelta, dict | None]]:
        """Each delta of ``job`` (recorded in its usage) with its chat chunk's choice (None:
        held back); ``EngineFailed`` when the engine fails the request."""
        started: set[int] = set()
        async for delta in job.stream:
            job.record(delta)
            if delta.finish_reason == "error":
                raise EngineFailed(job.stream.error or "the engine failed this request")
            choice = fmt.stream_choice(delta.index, delta.text, delta.logprobs,
                                       delta.finish_reason, delta.stop_reason,
                                       delta.index not in started)
            if choice is not None:
                started.add(delta.index)
            yield delta, choice

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.server_config.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.server_config.served_model_name!r}", "model",
                           "model_not_found")

    # ------------------------------------------------------------ streaming
    def _stream_flags(self, body: _Common) -> tuple[bool, bool, bool]:
        opts = body.stream_options
        default = self.server_config.default_continuous_usage_stats
        include_usage = opts.include_usage if opts and opts.include_usage is not None else default
        continuous = (opts.continuous_usage_stats if opts and opts.continuous_usage_stats
                      is not None else default)
        include_metrics = bool(opts and opts.include_metrics)
        return bool(include_usage), bool(include_usage and continuous), include_metrics

    async def _sse(self, job: Job, body: _Common, fmt: CompletionFormat) -> AsyncIterator[str]:
        include_usage, continuous, include_metrics = self._stream_flags(body)
        started: set[int] = set()
        head = {"id": job.response_id, "object": fmt.object_stream, "created": job.created,
                "model": self.server_config.served_model_name}
        async for delta in job.stream:
            job.record(delta)
            if delta.finish_reason == "error":
                event = error_body(500, job.stream.error or "the engine failed this request")
                if include_usage:
                    event["usage"] = job.usage.openai()
                yield _sse_data(event)
                job.stream.abort()
                break
            text = delta.text
            if job.echo_texts is not None and delta.index not in started:
                text = job.echo_texts[job.prompt_index(delta.index)] + text
            choice = fmt.stream_choice(delta.index, text, delta.logprobs, delta.finish_reason,
                                       delta.stop_reason, delta.index not in started)
            if choice is None:  # held back (a tool call being written): no chunk yet
                continue
            started.add(delta.index)
            chunk = {**head, "choices": [choice]}
            if continuous:
                prompt = len(job.prompt_ids[job.prompt_index(delta.index)])
                chunk["usage"] = {"prompt_tokens": prompt,
                                  "completion_tokens": delta.num_output_tokens,
                                  "total_tokens": prompt + delta.num_output_tokens}
            yield _sse_data(chunk)
        else:
            if include_usage or include_metrics:
                final = {**head, "choices": []}
                if include_usage:
                    final["usage"] = job.usage.openai()
                if include_metrics:
                    final["metrics"] = [job.metrics[i] for i in sorted(job.metrics)]
                yield _sse_data(final)
        yield "data: [DONE]\n\n"

    # --------------------------------------------------------- non-streaming
    async def _collect(self, job: Job, body: _Common, fmt: CompletionFormat) -> dict:
        total = len(job.prompt_ids) * job.params.n
        texts = [""] * total
        logprobs: list[list | None] = [None] * total
        finish: list[tuple[str | None, object]] = [(None, None)] * total
        async for delta in job.stream:
            job.record(delta)
            if delta.finish_reason == "error":
                raise APIError(500, job.stream.error or "the engine failed this request")
            texts[delta.index] += delta.text
            if delta.logprobs is not None:
                logprobs[delta.index] = (logprobs[delta.index] or []) + list(delta.logprobs)
            if delta.finished:
                finish[delta.index] = (delta.finish_reason, delta.stop_reason)
        choices = []
        for i in range(total):
            text = texts[i]
            if job.echo_texts is not None:
                text = job.echo_texts[job.prompt_index(i)] + text
            choices.append(fmt.full_choice(i, text, logprobs[i], *finish[i]))
        response = {"id": job.response_id, "object": fmt.object_full, "created": job.created,
                    "model": self.server_config.served_model_name, "choices": choices,
                    "usage": job.usage.openai()}
        if body.include_metrics:
            response["metrics"] = [job.metrics[i] for i in sorted(job.metrics)]
        return response


class _EngineStreamResponse(StreamingResponse):
    """An SSE response that closes its engine stream however it ends, even when the client
    leaves before the body starts (Starlette then never starts the generator)."""

    def __init__(self, stream: RequestStream, body: AsyncIterator[str]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def respond_json(stream: RequestStream, body: Awaitable[dict],
                       receive: Receive) -> Response:
    """``body`` as JSON, unless the client leaves first; ``stream`` is closed."""
    try:
        return JSONResponse(await _unless_disconnected(body, receive))
    except _ClientGone:  # the stream's close logs how each choice ended
        return Response(status_code=499)  # nobody reads it
    finally:
        stream.close()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled and
    ``_ClientGone`` raised. ``receive`` must be past the request body."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise _ClientGone


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

