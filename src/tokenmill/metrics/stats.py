"""Per-request lifecycle stats: interval maths over one request's timestamped events.

Standard library only. ``compute_request_stats`` takes the events of ONE engine request
(one choice of an ``n``-way request), frontend and core events mixed, every ``ts`` from
the same monotonic clock, and materialises them once, when the request has finished::

    ARRIVED  QUEUED  SCHEDULED  NEW_TOKENS  EMITTED ... NEW_TOKENS  EMITTED  FINISHED_EMITTED
       |       |         |          |          |            |          |            |
       |       |<-queue->|<-prefill>|<---------decode------>|          |            |
       |       |         |<-------------inference---------->|          |            |
       |<------------TTFT--------------------->|                       |            |
       |                                       |<-TPOT * (tokens - 1)->|            |
       |<-----------------------------------e2e------------------------------------>|

Invariants:

- "first X" / "last X" are by timestamp; events are ordered by ``ts`` (stably), so
  callers may hand them over in arrival order.
- Only events that carry tokens count as token events: NEW_TOKENS and EMITTED with
  ``num_tokens > 0`` (a final EMITTED chunk with no token does not move TTFT or TPOT).
- Preemption clears nothing: a request re-queued and re-scheduled keeps its first
  SCHEDULED and its token timestamps, so the time a preemption costs lands inside
  the prefill or decode interval during which it happened. Queue time is the first
  wait only; later waits are part of prefill or decode.
- A stat whose endpoints did not both happen is ``None`` (e.g. everything but e2e and
  TTFT for a request aborted before it was scheduled). TPOT needs two emitted tokens;
  mean ITL needs a second token step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tokenmill.core.records import FinishReason, RequestCounters, RequestEvent, RequestEventType

_E = RequestEventType


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Lifecycle stats of one finished request; times in seconds, ``None`` if not applicable."""

    queue_time: float | None
    time_to_first_token: float | None
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None
    time_per_output_token: float | None
    mean_inter_token_latency: float | None
    inter_token_latencies: tuple[float, ...]  # one sample per token after the first step's
    e2e_latency: float | None
    model_forward_time: float
    num_preemptions: int
    num_cached_tokens: int
    num_recomputed_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: FinishReason | None
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    priority: int = 0  # the request's scheduling priority (lower ran first)

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens; None when no draft was verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def to_dict(self) -> dict[str, float | int | str | None]:
        """The JSON shape used in API responses (ITL samples are left out: mean only)."""
        return {
            "queue_time": self.queue_time,
            "time_to_first_token": self.time_to_first_token,
            "prefill_time": self.prefill_time,
            "decode_time": self.decode_time,
            "inference_time": self.inference_time,
            "time_per_output_token": self.time_per_output_token,
            "mean_inter_token_latency": self.mean_inter_token_latency,
            "e2e_latency": self.e2e_latency,
            "model_forward_time": self.model_forward_time,
            "num_preemptions": self.num_preemptions,
            "num_cached_tokens": self.num_cached_tokens,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "priority": self.priority,
        }


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start


def _first_ts(events: Sequence[RequestEvent], kind: RequestEventType) -> float | None:
    return next((e.ts for e in events if e.type is kind), None)


def inter_token_latencies(token_events: Sequence[RequestEvent]) -> tuple[float, ...]:
    """ITL samples from NEW_TOKENS events in time order.

    A step that commits ``k`` tokens ``g`` seconds after the previous one gives ``k``
    samples of ``g / k``; the first step gives none (its wait is TTFT/prefill)::

        ts:      t0 (1 tok)      t1 (1 tok)        t2 (3 toks)
        samples:          t1-t0        (t2-t1)/3, (t2-t1)/3, (t2-t1)/3
    """
    samples: list[float] = []
    for prev, cur in zip(token_events, token_events[1:], strict=False):
        gap = cur.ts - prev.ts
        samples.extend([gap / cur.num_tokens] * cur.num_tokens)
    return tuple(samples)


def compute_request_stats(
    events: Sequence[RequestEvent],
    *,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    counters: RequestCounters,
    priority: int = 0,
) -> RequestStats:
    """Materialise one request's events into its stats (definitions: module docstring)."""
    ordered = sorted(events, key=lambda e: e.ts)
    new_tokens = [e for e in ordered if e.type is _E.NEW_TOKENS and e.num_tokens > 0]
    emitted = [e for e in ordered if e.type is _E.EMITTED and e.num_tokens > 0]
    arrived = _first_ts(ordered, _E.ARRIVED)
    scheduled = _first_ts(ordered, _E.SCHEDULED)
    first_token = new_tokens[0].ts if new_tokens else None
    last_token = new_tokens[-1].ts if new_tokens else None

    num_emitted = sum(e.num_tokens for e in emitted)
    tpot = None
    if num_emitted >= 2:
        tpot = (emitted[-1].ts - emitted[0].ts) / (num_emitted - 1)
    itl = inter_token_latencies(new_tokens)
    finished = next((e for e in ordered if e.type is _E.FINISHED), None)

    return RequestStats(
        queue_time=_diff(scheduled, _first_ts(ordered, _E.QUEUED)),
        time_to_first_token=_diff(emitted[0].ts if emitted else None, arrived),
        prefill_time=_diff(first_token, scheduled),
        decode_time=_diff(last_token, first_token),
        inference_time=_diff(last_token, scheduled),
        time_per_output_token=tpot,
        mean_inter_token_latency=sum(itl) / len(itl) if itl else None,
        inter_token_latencies=itl,
        e2e_latency=_diff(_first_ts(ordered, _E.FINISHED_EMITTED), arrived),
        num_cached_tokens=num_cached_tokens,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=sum(e.num_tokens for e in new_tokens),
        finish_reason=None if finished is None else finished.finish_reason,
        priority=priority,
        **asdict(counters),
    )
