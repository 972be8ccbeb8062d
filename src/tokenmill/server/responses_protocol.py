"""The Responses API's request body, and its translation into a chat request.

A Responses request is a chat request spelled differently: ``instructions`` is a system
turn before ``input``; ``input`` is a string (one user turn) or a list of items: messages
(``input_text`` / ``output_text`` parts, or a string), ``function_call`` items (an
assistant turn's tool calls; consecutive ones form one turn) and
``function_call_output`` items (tool turns); ``reasoning`` items are dropped, as chat
templates drop earlier reasoning. ``max_output_tokens`` is ``max_completion_tokens``,
``text.format`` is ``response_format``, and function tools are flat (``{"type":
"function", "name", ...}``) where chat nests them. So validation, the chat template,
tools and structured outputs are the chat endpoint's, and ``to_chat`` names the Responses
field in any error (``CHAT_TO_RESPONSES``).

The server keeps no state: ``previous_response_id``, ``conversation``, ``background``
and the other stateful or unimplemented fields get a 400.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from tokenmill.errors import InvalidParameterError
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    Float,
    FunctionDefinition,
    FunctionName,
    Text,
)

# the chat field an error names -> the Responses field it came from
CHAT_TO_RESPONSES = {"max_completion_tokens": "max_output_tokens", "max_tokens":
                     "max_output_tokens", "messages": "input", "prompt": "input",
                     "response_format": "text"}

# fields with no implementation here, and the values that ask for nothing
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,), "conversation": (None,), "background": (None, False),
    "prompt": (None,), "top_logprobs": (None, 0), "max_tool_calls": (None,),
    "include": (None, []),
}


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: Text
    name: FunctionName
    arguments: Text


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(FunctionDefinition):
    """A function tool: Responses spells chat's ``function`` fields at the top level."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: Text


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text = Field("response", min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: StrictBool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    store: StrictBool | None = None  # accepted; nothing is stored
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED

    def check_fields(self) -> None:
        extra = self.model_extra or {}
        for name, harmless in self._unsupported.items():
            if extra.get(name) not in harmless:
                why = ("this server keeps no responses or conversations; send the whole "
                       "conversation as input" if name in ("previous_response_id",
                                                            "conversation") else
                       "it is not supported by this server")
                raise InvalidParameterError(f"{name}: {why}", name)

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one asks for (``stream`` aside: the caller streams)."""
        self.check_fields()
        body: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                      "description": fmt.description}
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: v for k, v in schema.items() if v is not None}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "input"
            field = CHAT_TO_RESPONSES.get(field, field)
            raise InvalidParameterError(f"{field}: {first['msg']}", field) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(
            self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else "".join(
                    part.text for part in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": output})
        if not messages:
            raise InvalidParameterError("input must hold at least one message", "input")
        return messages
