"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over
the chat path.

The request becomes a chat request (``anthropic_protocol``), which ``OpenAIServing``
checks, renders and starts; the choice's chat deltas become content blocks through a
``BlockAssembler``: ``thinking`` (with a reasoning parser), ``text`` and ``tool_use``
(whose ``input`` is the call's arguments, parsed). A full message is the same feed as a
stream, so the two always agree.

A stream is Anthropic's event sequence: ``message_start`` (the message, empty, with the
prompt's usage), per block ``content_block_start``, its ``content_block_delta``s
(``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``;
then ``message_delta`` with the stop reason and the exact final usage, and
``message_stop``. A failure after the stream began is an ``error`` event.

``stop_reason``: ``tool_use`` when the text held tool calls, ``stop_sequence`` (with
``stop_sequence``) when one of ``stop_sequences`` ended it, ``max_tokens`` at the limit,
``end_turn`` otherwise (also when the server aborted the request at shutdown).

Errors on these endpoints have Anthropic's shape (``errors.anthropic_error_body``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from starlette.types import Receive

from tokenmill.server.anthropic_protocol import CHAT_TO_MESSAGES, MessagesRequest
from tokenmill.server.blocks import Block, BlockEvent
from tokenmill.server.chat_shaped import ChatShapedServing, Output
from tokenmill.server.errors import anthropic_error_body
from tokenmill.server.serving import EngineFailed


class MessagesServing(ChatShapedServing):
    renames = CHAT_TO_MESSAGES

    async def count_tokens(self, body: MessagesRequest) -> dict:
        """The prompt's tokens, as ``/v1/messages`` would count them."""
        return {"input_tokens": len((await self.plan(body.to_chat())).prompt_ids)}

    async def create(self, body: MessagesRequest, request_id: str, receive: Receive):
        message = _Message(await self.open(body.to_chat(), request_id), self.model)
        return await self.reply(message.output, body.stream, self._events(message),
                                message.body, receive)

    async def _events(self, message: _Message) -> AsyncIterator[str]:
        yield _event("message_start", message=message.body())
        try:
            async for event in self.blocks(message.output):
                yield _block_event(event)
        except EngineFailed as e:
            yield _event("error", error=anthropic_error_body(500, str(e))["error"])
            return
        yield _event("message_delta", delta={"stop_reason": message.stop_reason(),
                                             "stop_sequence": message.stop_sequence()},
                     usage=message.output.job.usage.anthropic())
        yield _event("message_stop")


class _Message:
    """One message being built: its output and how it ended."""

    def __init__(self, output: Output, model: str) -> None:
        self.output = output
        self.model = model
        self.id = "msg_" + output.key

    def stop_reason(self) -> str | None:
        if self.output.finish is None:
            return None
        reason, stop = self.output.finish
        if reason == "tool_calls":
            return "tool_use"
        if reason == "length":
            return "max_tokens"
        return "stop_sequence" if isinstance(stop, str) else "end_turn"

    def stop_sequence(self) -> str | None:
        stop = self.output.finish[1] if self.output.finish else None
        return stop if isinstance(stop, str) else None

    def body(self) -> dict:
        done = self.output.finish is not None
        blocks = self.output.assembler.blocks if done else []
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [_block(b) for b in blocks], "stop_reason": self.stop_reason(),
                "stop_sequence": self.stop_sequence(),
                "usage": self.output.job.usage.anthropic()}


def _block(block: Block, started: bool = False) -> dict:
    """A content block, whole; ``started``: as its ``content_block_start`` shows it."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if started else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if started else block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": {} if started else _arguments(block.text)}


def _arguments(text: str) -> dict:
    """A call's arguments as an object (a call whose text is no JSON object gets {})."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _block_event(event: BlockEvent) -> str:
    block = event.block
    if event.type == "start":
        return _event("content_block_start", index=block.index,
                      content_block=_block(block, started=True))
    if event.type == "stop":
        return _event("content_block_stop", index=block.index)
    delta = ({"type": "thinking_delta", "thinking": event.text} if block.kind == "reasoning"
             else {"type": "text_delta", "text": event.text} if block.kind == "text"
             else {"type": "input_json_delta", "partial_json": event.text})
    return _event("content_block_delta", index=block.index, delta=delta)


def _event(kind: str, **fields) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
