"""Request lifecycle stats on fixed timestamps (SPEC section 3 definitions)."""

from __future__ import annotations

import json

import pytest

from tokenmill.core.records import FinishReason, RequestCounters, RequestEvent, RequestEventType
from tokenmill.metrics.stats import RequestStats, compute_request_stats

E = RequestEventType


def ev(kind: RequestEventType, ts: float, num_tokens: int = 0, reason=None) -> RequestEvent:
    return RequestEvent(kind, ts, num_tokens=num_tokens, finish_reason=reason)


def stats(events, num_prompt_tokens: int = 7, num_cached_tokens: int = 0,
          **counters) -> RequestStats:
    return compute_request_stats(events, num_prompt_tokens=num_prompt_tokens,
                                 num_cached_tokens=num_cached_tokens,
                                 counters=RequestCounters(**counters))


def token_step(ts: float, k: int, emit_delay: float = 0.01) -> list[RequestEvent]:
    """The core commits k tokens at ts; the frontend emits them emit_delay later."""
    return [ev(E.NEW_TOKENS, ts, k), ev(E.EMITTED, ts + emit_delay, k)]


def admitted(arrive: float, queued: float, scheduled: float) -> list[RequestEvent]:
    return [
        ev(E.ARRIVED, arrive),
        ev(E.INPUT_PROCESSED, queued),
        ev(E.QUEUED, queued),
        ev(E.SCHEDULED, scheduled),
        ev(E.PREFILLING, scheduled),
    ]


def finished(core_ts: float, reason: FinishReason, emitted_ts: float) -> list[RequestEvent]:
    return [ev(E.FINISHED, core_ts, reason=reason), ev(E.FINISHED_EMITTED, emitted_ts)]


def test_streamed_request_all_intervals():
    events = [
        *admitted(0.0, 0.02, 0.05),
        *token_step(0.25, 1),
        ev(E.DECODING, 0.25),
        *token_step(0.35, 1),
        *token_step(0.45, 1, emit_delay=0.02),
        *finished(0.45, FinishReason.STOP, 0.5),
    ]
    s = stats(events, model_forward_time=0.3, num_cached_tokens=4)
    assert s.queue_time == pytest.approx(0.03)
    assert s.time_to_first_token == pytest.approx(0.26)  # includes tokenise, queue, detokenise
    assert s.prefill_time == pytest.approx(0.20)
    assert s.decode_time == pytest.approx(0.20)
    assert s.inference_time == pytest.approx(0.40)
    assert s.time_per_output_token == pytest.approx((0.47 - 0.26) / 2)
    assert s.inter_token_latencies == pytest.approx((0.1, 0.1))
    assert s.mean_inter_token_latency == pytest.approx(0.1)
    assert s.e2e_latency == pytest.approx(0.5)
    assert s.num_generation_tokens == 3
    assert s.finish_reason is FinishReason.STOP
    assert (s.model_forward_time, s.num_cached_tokens, s.num_prompt_tokens) == (0.3, 4, 7)


def test_k_token_step_gives_k_itl_samples():
    # speculative decoding: the third step commits 3 tokens 0.6 s after the second
    events = [
        *admitted(0.0, 0.0, 0.5),
        *token_step(1.0, 1),
        *token_step(1.2, 1),
        *token_step(1.8, 3),
        *finished(1.8, FinishReason.LENGTH, 1.9),
    ]
    s = stats(events)
    assert s.inter_token_latencies == pytest.approx((0.2, 0.2, 0.2, 0.2))
    assert s.mean_inter_token_latency == pytest.approx(0.2)
    assert s.num_generation_tokens == 5
    assert s.time_per_output_token == pytest.approx(0.8 / 4)  # 5 emitted tokens
    assert s.decode_time == pytest.approx(0.8)
    assert s.finish_reason is FinishReason.LENGTH


def test_preemption_during_decode_stays_in_decode_and_keeps_token_times():
    events = [
        *admitted(0.0, 0.0, 1.0),
        *token_step(2.0, 1),
        *token_step(3.0, 1),
        ev(E.PREEMPTED, 3.5),
        ev(E.QUEUED, 3.5),
        ev(E.SCHEDULED, 5.0),
        ev(E.PREFILLING, 5.0),  # recompute prompt + 2 generated tokens
        *token_step(6.0, 1),
        ev(E.DECODING, 6.0),
        *token_step(6.5, 1),
        *finished(6.5, FinishReason.STOP, 7.0),
    ]
    s = stats(events, num_preemptions=1, num_recomputed_tokens=9, model_forward_time=1.25)
    assert s.queue_time == pytest.approx(1.0)  # the first wait only
    assert s.prefill_time == pytest.approx(1.0)  # from the FIRST scheduling
    assert s.decode_time == pytest.approx(4.5)  # 2.0 -> 6.5, the 1.5 s requeue inside it
    assert s.inference_time == pytest.approx(5.5)
    assert s.inter_token_latencies == pytest.approx((1.0, 3.0, 0.5))  # the gap lands on one token
    assert s.num_generation_tokens == 4
    assert (s.num_preemptions, s.num_recomputed_tokens, s.model_forward_time) == (1, 9, 1.25)


def test_preemption_during_prefill_stays_in_prefill():
    events = [
        *admitted(0.0, 0.0, 1.0),
        ev(E.PREEMPTED, 1.5),  # mid chunked prefill
        ev(E.QUEUED, 1.5),
        ev(E.SCHEDULED, 3.0),
        ev(E.PREFILLING, 3.0),
        *token_step(4.0, 1),
        *finished(4.0, FinishReason.STOP, 4.1),
    ]
    s = stats(events, num_preemptions=1)
    assert s.queue_time == pytest.approx(1.0)
    assert s.prefill_time == pytest.approx(3.0)
    assert s.time_to_first_token == pytest.approx(4.01)


def test_abort_before_scheduling_leaves_unreached_stats_none():
    events = [
        ev(E.ARRIVED, 0.0),
        ev(E.INPUT_PROCESSED, 0.1),
        ev(E.QUEUED, 0.1),
        *finished(2.0, FinishReason.ABORT, 2.01),
    ]
    s = stats(events)
    for name in (
        "queue_time",
        "time_to_first_token",
        "prefill_time",
        "decode_time",
        "inference_time",
        "time_per_output_token",
        "mean_inter_token_latency",
    ):
        assert getattr(s, name) is None, name
    assert s.e2e_latency == pytest.approx(2.01)
    assert s.num_generation_tokens == 0
    assert s.inter_token_latencies == ()
    assert s.to_dict()["finish_reason"] == "abort"


def test_single_token_request():
    events = [
        *admitted(0.0, 0.0, 0.1),
        *token_step(0.3, 1),
        *finished(0.3, FinishReason.LENGTH, 0.32),
    ]
    s = stats(events)
    assert s.time_per_output_token is None
    assert s.mean_inter_token_latency is None
    assert s.inter_token_latencies == ()
    assert s.decode_time == 0.0
    assert s.prefill_time == pytest.approx(0.2)
    assert s.inference_time == s.prefill_time
    assert s.num_generation_tokens == 1


def test_tokenless_chunks_and_event_order_do_not_matter():
    """An empty final EMITTED moves neither TTFT nor TPOT; events may arrive interleaved."""
    events = [
        *admitted(0.0, 0.0, 0.1),
        *token_step(0.3, 1),
        *token_step(0.5, 1),
        ev(E.EMITTED, 0.9, 0),  # finish chunk with no token
        *finished(0.5, FinishReason.STOP, 0.95),
    ]
    expected = stats(events)
    assert expected.time_to_first_token == pytest.approx(0.31)
    assert expected.time_per_output_token == pytest.approx(0.2)
    shuffled = events[::2] + events[1::2]
    assert stats(shuffled) == expected


def test_to_dict_has_the_api_shape_and_is_json():
    events = [*admitted(0.0, 0.0, 0.1), *token_step(0.3, 1), *finished(0.3, FinishReason.STOP, 1)]
    d = stats(events).to_dict()
    assert list(d) == [
        "queue_time",
        "time_to_first_token",
        "prefill_time",
        "decode_time",
        "inference_time",
        "time_per_output_token",
        "mean_inter_token_latency",
        "e2e_latency",
        "model_forward_time",
        "num_preemptions",
        "num_cached_tokens",
        "num_recomputed_tokens",
        "num_prompt_tokens",
        "num_generation_tokens",
        "finish_reason",
        "num_draft_tokens",
        "num_accepted_tokens",
        "draft_acceptance_rate",
        "priority",
    ]
    assert json.loads(json.dumps(d)) == d
    assert d["draft_acceptance_rate"] is None
    assert d["finish_reason"] == "stop" and d["e2e_latency"] == 1.0
    assert d["priority"] == 0
