"""Anthropic's Messages API request body, and its translation into a chat request.

``system`` (a string or text blocks) becomes a system turn; each message's content is a
string or a list of blocks: ``text``, ``tool_use`` (an assistant turn's tool calls, whose
``input`` becomes the call's JSON arguments), ``tool_result`` (the answer to a call: a
tool turn, before the rest of that user turn's text) and ``thinking`` (earlier
reasoning, dropped as chat templates drop it). ``tools`` are ``{"name", "description",
"input_schema"}``; ``tool_choice`` ``auto``, ``any`` (chat's ``required``), ``tool``
(a named function) or ``none``, and ``disable_parallel_tool_use``. ``temperature``,
``top_p`` and ``top_k`` are read from the body when a client sends them. ``thinking`` is
accepted: whether the model reasons is its chat template's and ``--reasoning-parser``'s
matter. Validation, the chat template, tools and limits are then the chat endpoint's,
and ``to_chat`` names the Messages field in any error (``CHAT_TO_MESSAGES``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from tokenmill.errors import InvalidParameterError
from tokenmill.server.protocol import ChatCompletionRequest, Float, FunctionName, Text

# the chat field an error names -> the Messages field it came from
CHAT_TO_MESSAGES = {"max_tokens": "max_tokens", "stop": "stop_sequences", "prompt": "messages"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: Text
    name: FunctionName
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: StrictBool = False


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: Text | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt
    system: Text | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one asks for (``stream`` aside: the caller streams)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(),
                                "max_tokens": self.max_tokens}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description else {})}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                if not choice.name:
                    raise InvalidParameterError("tool_choice of type tool needs a name",
                                                "tool_choice")
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "messages"
            raise InvalidParameterError(f"{field}: {first['msg']}", field) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "".join(
                b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            if isinstance(message.content, str):
                messages.append({"role": message.role, "content": message.content})
                continue
            texts = [b.text for b in message.content if isinstance(b, TextBlock)]
            calls = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in message.content if isinstance(b, ToolUseBlock)]
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    if message.role != "user":
                        raise InvalidParameterError("tool_result blocks belong in user "
                                                    "messages", "messages")
                    content = block.content if isinstance(block.content, str) else "".join(
                        b.text for b in block.content)
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": content})
            if calls and message.role != "assistant":
                raise InvalidParameterError("tool_use blocks belong in assistant messages",
                                            "messages")
            if calls:
                messages.append({"role": "assistant", "content": "".join(texts) or None,
                                 "tool_calls": calls})
            elif texts or not any(isinstance(b, ToolResultBlock) for b in message.content):
                messages.append({"role": message.role, "content": "".join(texts)})
        return messages


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: StrictInt | None = None  # type: ignore[assignment]
