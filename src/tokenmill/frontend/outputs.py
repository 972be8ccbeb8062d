"""What callers of the frontend receive: per-choice deltas (streaming) and vLLM-shaped
cumulative outputs (offline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.types import TokenLogprob
from tokenmill.metrics.stats import RequestStats


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one engine step added to one choice, after detokenisation.

    ``token_ids`` may be empty only on a choice's final delta (a finish with no new
    token, e.g. an abort); ``text`` may be "" while ``token_ids`` is not (a token that
    completes no character yet).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    num_output_tokens: int  # cumulative tokens of this choice, this delta included
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stats: RequestStats | None = None  # on the final delta
    embedding: tuple[float, ...] | None = None  # an embedding request's, on its final delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stats: RequestStats | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.stats = delta.stats


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
