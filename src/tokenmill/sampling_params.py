"""Per-request sampling settings, named as in vLLM's ``SamplingParams``.

Invariant: an instance that exists has passed ``validate()``; every bad value raises
``InvalidParameterError`` naming the offending field, which the server turns into an
HTTP 400 with an OpenAI error body and the CLI into a one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenmill.errors import InvalidParameterError

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar")
POOLING_KINDS = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request: its prompt's hidden states after the model's final norm,
    pooled into one vector, instead of generated tokens.

    ``kind``: "last" (the last token's state; a decoder's default, as vLLM's embedding
    conversion of a decoder), "mean" (the mean over every prompt token) or "cls" (the first
    token's). ``normalize``: the vector scaled to unit L2 norm (vLLM's default).
    """

    kind: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        _check(self.kind in POOLING_KINDS,
               f"pooling must be one of {', '.join(POOLING_KINDS)}", "pooling")
        _check(isinstance(self.normalize, bool), "normalize must be true or false", "normalize")

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt position must be computed (no prefix-cache hit may skip
        one): all but "last", whose one position is always computed."""
        return self.kind != "last"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output, which a grammar engine enforces token by token
    (``tokenmill.structured``). Frozen and hashable: compiled grammars are cached by it.

    ``kind`` names the language of ``spec``:

    - ``"json"``: a JSON schema, as JSON text (``{"type": "object"}`` is any object);
    - ``"regex"``: a regular expression that the whole output matches;
    - ``"choice"``: a JSON list of strings, of which the output is exactly one;
    - ``"grammar"``: a context-free grammar, in Lark or GBNF (llama.cpp's EBNF) syntax.

    ``whitespace`` (``"json"`` only): the whitespace allowed between JSON tokens, as a
    regex; None for the default (at most one space, or one line break and an indent of
    up to 20), "" for none.

    ``after`` (a reasoning model's end-of-reasoning marker, such as ``</think>``): the
    constraint applies from the end of the reasoning; before it, the output is free text
    up to and including the first ``after`` (and at most two line breaks). None: from the
    first token.
    """

    kind: str
    spec: str
    whitespace: str | None = None
    after: str | None = None

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_OUTPUT_KINDS,
               f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
               "structured_output")
        _check(isinstance(self.spec, str), "a structured output's spec is text",
               "structured_output")
        _check(self.after is None or (isinstance(self.after, str) and bool(self.after)),
               "a structured output's end-of-reasoning marker is non-empty text",
               "structured_output")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # None: unconstrained
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias):
    # -100 bans a token, 100 all but forces it; None or {}: no bias.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n must be at least 1", "n")
        _check(self.temperature >= 0.0, "temperature must be non-negative", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= 0, "top_k must be -1 (disabled), 0 (disabled) or positive", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        _check(0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty must be in (0, 2]", "repetition_penalty")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   "min_tokens must not exceed max_tokens", "min_tokens")
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs must be non-negative", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   and isinstance(b, (int, float)) and -100.0 <= b <= 100.0
                   for t, b in (self.logit_bias or {}).items()),
               "logit_bias maps token ids to biases in [-100, 100]", "logit_bias")
        _check(self.structured_output is None
               or isinstance(self.structured_output, StructuredOutput),
               "structured_output must be a StructuredOutput", "structured_output")

    def for_child(self, index: int) -> SamplingParams:
        """Settings for choice ``index`` of an ``n``-way request: n=1, and a distinct seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidParameterError(message, param)
