"""Request bodies of the OpenAI-compatible API (plus vLLM's extras), and their mapping
onto ``SamplingParams``.

Pydantic checks types strictly, as the OpenAI API does: a number is not a string, a
boolean is not a number, text is valid Unicode, floats are finite. Ranges are checked
once, by ``SamplingParams.validate``; the server's configurable caps (``RequestLimits``)
after that. Unknown fields are ignored, as vLLM does, except the OpenAI fields tokenmill
does not implement, which get a 400 rather than being silently dropped.

Structured outputs come as OpenAI's ``response_format`` or as vLLM's ``structured_outputs``
(or its older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``);
``structured_output()`` turns whichever is set into one ``StructuredOutput``, naming the
field for any error. Tools (chat) are ``server/tools.py``'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    model_validator,
)

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import SamplingParams, StructuredOutput


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it has a lone surrogate)") from None
    return text


Text = Annotated[str, Field(strict=True), AfterValidator(_valid_unicode)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
# vLLM's seed range: a signed or unsigned 64-bit integer
Seed = Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 64)]
TokenIds = list[StrictInt]

# OpenAI fields with no implementation here, and the values that ask for nothing;
# a request that sets one to anything else gets a 400
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1),
    "functions": (None, []), "function_call": (None, "none"),
}
# Chat-only fields that the completions endpoint refuses rather than ignores
_CHAT_ONLY: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none")}


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar,
    json_object; the whitespace options apply to JSON."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    structural_tag: Any = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: Text | None = None


ANY_JSON_OBJECT = '{"type":"object"}'


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None
    include_metrics: StrictBool = False  # tokenmill: per-request metrics on the final chunk


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    n: StrictInt = 1
    temperature: Float | None = None
    top_p: Float | None = None
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[Text, Float] | None = None
    # vLLM's: lower runs first (with --scheduling-policy priority; else it must be 0)
    priority: Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)] = 0
    user: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: Float = 0.0
    repetition_penalty: Float = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # tokenmill: per-request metrics in a non-streaming response
    include_metrics: StrictBool = False
    # structured outputs: OpenAI's, then vLLM's (current and older names)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    guided_decoding_backend: Text | None = None  # accepted and ignored (one backend here)

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED

    def check_fields(self) -> None:
        """What types alone cannot say: unsupported fields, stream_options without stream."""
        extra = self.model_extra or {}
        for name, harmless in self._unsupported.items():
            if extra.get(name) not in harmless:
                raise InvalidParameterError(f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options is only allowed when stream is true",
                                        "stream_options")

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The request's output constraint and the field that set it; at most one field may."""
        found: list[tuple[StructuredOutput, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((StructuredOutput("json", ANY_JSON_OBJECT), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidParameterError("response_format of type json_schema needs "
                                            "json_schema", "response_format")
            schema = fmt.json_schema.schema_
            spec = ANY_JSON_OBJECT if schema is None else json.dumps(schema)
            found.append((StructuredOutput("json", spec), "response_format"))
        if self.structured_outputs is not None:
            found.extend((c, "structured_outputs") for c in _from_vllm(self.structured_outputs))
        whitespace = self.guided_whitespace_pattern
        if self.guided_json is not None:
            found.append((_json_constraint(self.guided_json, whitespace), "guided_json"))
        if self.guided_regex is not None:
            found.append((StructuredOutput("regex", self.guided_regex), "guided_regex"))
        if self.guided_choice is not None:
            found.append((StructuredOutput("choice", json.dumps(self.guided_choice)),
                          "guided_choice"))
        if self.guided_grammar is not None:
            found.append((StructuredOutput("grammar", self.guided_grammar), "guided_grammar"))
        if len(found) > 1:
            names = sorted({name for _, name in found})
            raise InvalidParameterError(
                "give at most one output constraint; this request sets "
                + (" and ".join(names) if len(names) > 1 else f"several in {names[0]}"),
                found[1][1])
        return found[0] if found else (None, None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_output=structured_output,
            logit_bias=_logit_bias(self.logit_bias),
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer keys; ranges
    are ``SamplingParams``'s to check, and the vocabulary the input processor's."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidParameterError(
                f"logit_bias keys are token ids; {key!r} is not one", "logit_bias")
        out[int(key)] = value
    return out


def _from_vllm(params: StructuredOutputsParams) -> list[StructuredOutput]:
    if params.structural_tag is not None:
        raise InvalidParameterError("structured_outputs.structural_tag is not supported by "
                                    "this server", "structured_outputs")
    whitespace = "" if params.disable_any_whitespace else params.whitespace_pattern
    found = []
    if params.json_ is not None:
        found.append(_json_constraint(params.json_, whitespace,
                                      params.disable_additional_properties))
    if params.json_object:
        found.append(StructuredOutput("json", ANY_JSON_OBJECT, whitespace))
    if params.regex is not None:
        found.append(StructuredOutput("regex", params.regex))
    if params.choice is not None:
        found.append(StructuredOutput("choice", json.dumps(params.choice)))
    if params.grammar is not None:
        found.append(StructuredOutput("grammar", params.grammar))
    if not found:
        raise InvalidParameterError("structured_outputs needs one of json, regex, choice, "
                                    "grammar or json_object", "structured_outputs")
    return found


def _json_constraint(schema: dict[str, Any] | str, whitespace: str | None,
                     no_additional_properties: bool = False) -> StructuredOutput:
    """A schema given as an object or as JSON text (vLLM accepts both)."""
    if no_additional_properties:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                pass  # reported as not JSON when the schema is checked
        if isinstance(schema, dict):
            schema = _closed(schema)
    spec = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutput("json", spec, whitespace)


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not
    say (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) \
            and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


class CompletionRequest(_Common):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    _unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {**_UNSUPPORTED, **_CHAT_ONLY}

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        return text_or_token_list(self.prompt, "prompt")

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, self.structured_output()[0])


def text_or_token_list(given: str | list[str] | list[int] | list[list[int]],
                       param: str) -> list[str | list[int]]:
    """OpenAI's text, texts, token ids or lists of token ids, as one entry per item."""
    if isinstance(given, str):
        return [given]
    if not given:
        raise InvalidParameterError(f"{param} must not be empty", param)
    if all(isinstance(x, int) for x in given):
        return [list(given)]  # type: ignore[arg-type]
    return list(given)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    arguments: Text  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One turn. ``content`` may be null (an empty turn) only for the assistant; a
    ``tool`` turn answers the assistant's call ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (as transformers passes it): a tool call's
        arguments as an object where they are a JSON object."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls", ()):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except json.JSONDecodeError:
                continue
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs to be true",
                                        "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidParameterError("top_logprobs must be non-negative", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.structured_output()[0])


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None  # with messages: the prompt a chat request with them gets


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: TokenIds
