"""Plain records passed between the scheduler, the model runner and the engine's callers.

``SchedulerOutput`` -> model runner -> ``ModelRunnerOutput`` -> scheduler ->
``EngineCoreOutputs``. The last crosses to the frontend, so it holds only frozen,
picklable values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.core.records import (
    FinishReason,
    IterationStats,
    RequestCounters,
    RequestEvent,
    SchedulerStats,
    pickled_by_fields,
)
from tokenmill.sampling_params import PoolingParams, SamplingParams
from tokenmill.structured.matcher import RequestGrammar


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    It computes ``token_ids`` at positions ``start_pos ..``; when ``sample`` is set those
    tokens reach the end of the request's sequence and the last one's logits give its
    next token. With speculative decoding, ``token_ids`` end with ``draft_token_ids``
    (proposed, not yet output) and each of the last ``1 + len(draft_token_ids)``
    positions is sampled to verify them (see spec_decode.py).
    """

    req_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool
    sampling_params: SamplingParams
    # NOTE: the request's own lists, not copies (no per-step O(length) copy); read-only,
    # and valid only until the scheduler's update for this step.
    prompt_token_ids: Sequence[int]  # for penalties
    output_token_ids: Sequence[int]  # for penalties and seeding
    mask_stop_tokens: frozenset[int] = frozenset()  # banned while below min_tokens
    draft_token_ids: tuple[int, ...] = ()
    # NOTE: the request's own grammar state (a structured output), read-only here: the
    # sampler's masks come from it; the scheduler feeds it the committed tokens.
    grammar: RequestGrammar | None = None
    # An embedding request (never sampled): the runner pools this chunk's hidden states
    # (``ModelRunnerOutput.pooled``).
    pooling: PoolingParams | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    finished_req_ids: frozenset[str]  # finished since the last step: drop their state

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Tokens to commit, per request scheduled with ``sample``: one per step without
    speculative decoding, k >= 1 with it (accepted drafts plus the bonus token)."""

    sampled: dict[str, tuple[int, ...]]
    logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    forward_time: float = 0.0
    # Per embedding request in the step, its chunk's share of the pooled vector (after the
    # final norm, float32): "mean" the sum of the chunk's rows; "cls" the first position's
    # row (only in the chunk holding it); "last" the last position's (only in the last chunk).
    pooled: dict[str, list[float]] = field(default_factory=dict)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What changed for one request in one step (new tokens and/or finished)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None
    events: tuple[RequestEvent, ...]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    counters: RequestCounters | None = None  # its lifetime counters, once finished
    error: str | None = None  # with finish reason "error": why, when the core knows
    stop_string: str | None = None  # the stop string that ended it (then nothing else did)
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, once finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class EngineCoreOutputs:
    outputs: tuple[EngineCoreOutput, ...]
    scheduler_stats: SchedulerStats
    iteration_stats: IterationStats | None  # None when the step ran nothing
