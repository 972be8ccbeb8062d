"""Request bodies of the OpenAI-compatible API (plus vLLM's extras), and their mapping
onto ``SamplingParams``.

Pydantic checks types strictly, as the OpenAI API does: a number is not a string, a
boolean is not a number, text is valid Unicode, floats are finite. Ranges are checked
once, by ``SamplingParams.validate``; the server's configurable caps (``RequestLimits``)
after that. Unknown fields are ignored, as vLLM does, except the OpenAI fields tokenmill
does not implement, which get a 400 rather than being silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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
from tokenmill.sampling_params import SamplingParams


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
    "suffix": (None, ""), "logit_bias": (None, {}), "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
}


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

    def check_fields(self) -> None:
        """What types alone cannot say: unsupported fields, stream_options without stream."""
        extra = self.model_extra or {}
        for name, harmless in _UNSUPPORTED.items():
            if extra.get(name) not in harmless:
                raise InvalidParameterError(f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options is only allowed when stream is true",
                                        "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
        )


class CompletionRequest(_Common):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidParameterError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One turn. ``content`` may be null (an empty turn) only for the assistant."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs to be true",
                                        "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise InvalidParameterError("top_logprobs must be non-negative", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: TokenIds
