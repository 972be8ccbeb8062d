"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

The request becomes a chat request (``responses_protocol``), which ``OpenAIServing``
checks, renders and starts; the choice's chat deltas become output items through a
``BlockAssembler``: reasoning (``reasoning`` items, with a reasoning parser), text (one
``message`` item per run of text) and tool calls (``function_call`` items). A full
response is the same feed as a stream, so the two always agree.

A stream is the official event sequence: ``response.created``, ``response.in_progress``;
per item ``response.output_item.added``, ``response.content_part.added`` (messages and
reasoning), its deltas (``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), then the matching ``.done`` events and
``response.output_item.done``; last ``response.completed`` (its response's ``status`` is
``incomplete`` when ``max_output_tokens`` cut it, ``cancelled`` when the server aborted it),
or ``response.failed`` when the engine failed it; either carries the exact usage. Every
event has its ``sequence_number``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.types import Receive

from tokenmill.errors import InvalidParameterError
from tokenmill.server.blocks import Block, BlockEvent
from tokenmill.server.chat_shaped import ChatShapedServing, Output
from tokenmill.server.responses_protocol import CHAT_TO_RESPONSES, ResponsesRequest
from tokenmill.server.serving import EngineFailed

_ITEM_PREFIX = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}


class ResponsesServing(ChatShapedServing):
    renames = CHAT_TO_RESPONSES

    def renamed(self, error: InvalidParameterError) -> InvalidParameterError:
        message = str(error)
        for chat in ("max_completion_tokens", "max_tokens", "response_format"):
            message = message.replace(chat, CHAT_TO_RESPONSES[chat])
        return InvalidParameterError(message, self.renames.get(error.param or "", error.param))

    async def create(self, body: ResponsesRequest, request_id: str, receive: Receive):
        response = _Response(body, await self.open(body.to_chat(), request_id), self.model)
        return await self.reply(response.output, body.stream, self._events(response),
                                response.body, receive)

    async def _events(self, response: _Response) -> AsyncIterator[str]:
        yield response.event("response.created", response=response.body())
        yield response.event("response.in_progress", response=response.body())
        try:
            async for event in self.blocks(response.output):
                for sse in response.block_events(event):
                    yield sse
        except EngineFailed as e:
            response.output.error = str(e)
        last = "response.failed" if response.output.error else "response.completed"
        yield response.event(last, response=response.body())


class _Response:
    """One response being built: its output, status and events."""

    def __init__(self, request: ResponsesRequest, output: Output, model: str) -> None:
        self.request = request
        self.output = output
        self.model = model
        self.id = "resp_" + output.key
        self.created_at = time.time()
        self.sequence_number = 0

    def status(self) -> str:
        if self.output.error is not None:
            return "failed"
        if self.output.finish is None:
            return "in_progress"
        return {"length": "incomplete", "abort": "cancelled"}.get(self.output.finish[0],
                                                                   "completed")

    def body(self) -> dict:
        status = self.status()
        request = self.request
        fmt = request.text.format if request.text and request.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model,
            "output": [self.item(b, status != "in_progress")
                       for b in self.output.assembler.blocks],
            "error": None if self.output.error is None else {
                "code": "server_error", "message": self.output.error},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls":
            request.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": request.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "tool_choice": _dump(request.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or ()],
            "top_p": request.top_p, "truncation": "disabled", "user": request.user,
            "usage": None if status == "in_progress" else self.output.job.usage.responses(),
        }

    def item(self, block: Block, done: bool) -> dict:
        status = "in_progress" if not done else (
            "incomplete" if self.status() == "incomplete" else "completed")
        item_id = _ITEM_PREFIX[block.kind] + f"{self.output.key}_{block.index}"
        if block.kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                    "content": [_part(block)] if done else []}
        if block.kind == "text":
            return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                    "content": [_part(block)] if done else []}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id,
                "name": block.name, "arguments": block.text if done else "", "status": status}

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def block_events(self, event: BlockEvent) -> list[str]:
        block = event.block
        item_id = _ITEM_PREFIX[block.kind] + f"{self.output.key}_{block.index}"
        where = {"item_id": item_id, "output_index": block.index}
        part = {"content_index": 0, **where}
        if event.type == "start":
            events = [self.event("response.output_item.added", output_index=block.index,
                                 item=self.item(block, False))]
            if block.kind != "tool_call":
                empty = _part(Block(block.kind, block.index))
                events.append(self.event("response.content_part.added", **part, part=empty))
            return events
        if event.type == "delta":
            if block.kind == "tool_call":
                return [self.event("response.function_call_arguments.delta", **where,
                                   delta=event.text)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **part, delta=event.text)]
            return [self.event("response.output_text.delta", **part, delta=event.text,
                               logprobs=[])]
        if block.kind == "tool_call":
            events = [self.event("response.function_call_arguments.done", **where,
                                 name=block.name, arguments=block.text)]
        else:
            kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
            events = [self.event(f"response.{kind}.done", **part, text=block.text,
                                 **({} if block.kind == "reasoning" else {"logprobs": []})),
                      self.event("response.content_part.done", **part, part=_part(block))]
        events.append(self.event("response.output_item.done", output_index=block.index,
                                 item=self.item(block, True)))
        return events


def _part(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def _dump(value):
    return value.model_dump() if hasattr(value, "model_dump") else value
