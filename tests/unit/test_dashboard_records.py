"""The dashboard's data on fixed timestamps: request timelines and the per-second engine
history with its latency percentiles."""

from __future__ import annotations

import pytest

from tokenmill.core.records import (
    FinishReason,
    IterationStats,
    RequestCounters,
    RequestEvent,
    RequestEventType,
    SchedulerStats,
)
from tokenmill.metrics.history import SAMPLE_FIELDS, EngineHistory, percentiles
from tokenmill.metrics.stats import compute_request_stats
from tokenmill.metrics.timeline import Timeline

E = RequestEventType


def ev(kind: RequestEventType, ts: float, num_tokens: int = 0, reason=None) -> RequestEvent:
    return RequestEvent(kind, ts, num_tokens=num_tokens, finish_reason=reason)


def phases(tl: Timeline) -> list[tuple[str, float, float | None]]:
    return [(s.state, s.start, s.end) for s in tl.segments]


PREEMPTED_ONCE = [
    ev(E.ARRIVED, 0.0), ev(E.INPUT_PROCESSED, 0.1), ev(E.QUEUED, 0.1),
    ev(E.SCHEDULED, 0.5), ev(E.PREFILLING, 0.5),
    ev(E.NEW_TOKENS, 1.0, 1), ev(E.DECODING, 1.0), ev(E.EMITTED, 1.1, 1),
    ev(E.NEW_TOKENS, 1.5, 1), ev(E.PREEMPTED, 2.0), ev(E.QUEUED, 2.0), ev(E.EMITTED, 2.1, 1),
    ev(E.SCHEDULED, 3.0), ev(E.PREFILLING, 3.0), ev(E.NEW_TOKENS, 3.5, 1), ev(E.DECODING, 3.5),
    ev(E.NEW_TOKENS, 4.0, 1), ev(E.FINISHED, 4.0, reason=FinishReason.LENGTH),
    ev(E.EMITTED, 4.1, 2), ev(E.FINISHED_EMITTED, 4.1),
]


def test_timeline_phases_of_a_preempted_request() -> None:
    tl = Timeline()
    tl.feed(PREEMPTED_ONCE)
    assert phases(tl) == [("queued", 0.0, 0.5), ("prefilling", 0.5, 1.0),
                          ("decoding", 1.0, 2.0), ("preempted", 2.0, 3.0),
                          ("prefilling", 3.0, 3.5), ("decoding", 3.5, 4.0)]
    assert tl.status() == "finished" and tl.end == 4.0 and tl.num_preemptions == 1
    stats = compute_request_stats(PREEMPTED_ONCE, num_prompt_tokens=3, num_cached_tokens=0,
                                  counters=RequestCounters(num_preemptions=1,
                                                           num_recomputed_tokens=4))
    assert tl.time_to_first_token == pytest.approx(stats.time_to_first_token)


def test_timeline_fed_incrementally_matches_fed_at_once() -> None:
    events: list[RequestEvent] = []
    tl = Timeline()
    statuses = []
    for event in PREEMPTED_ONCE:
        events.append(event)
        tl.feed(events)
        statuses.append(tl.status())
        assert all(s.end is not None for s in tl.segments[:-1])
    whole = Timeline()
    whole.feed(PREEMPTED_ONCE)
    assert phases(tl) == phases(whole)
    assert statuses[0] == "queued" and "prefilling" in statuses and "preempted" in statuses
    assert statuses[-1] == "finished"


@pytest.mark.parametrize(("reason", "override", "status"), [
    (FinishReason.ABORT, None, "aborted"),
    (FinishReason.ABORT, FinishReason.STOP, "finished"),  # a stop string
    (FinishReason.ERROR, None, "error"),
])
def test_timeline_status_of_ended_requests(reason, override, status) -> None:
    tl = Timeline()
    tl.feed([ev(E.ARRIVED, 0.0), ev(E.QUEUED, 0.0), ev(E.FINISHED, 0.2, reason=reason)])
    assert tl.status(override) == status
    assert phases(tl) == [("queued", 0.0, 0.2)]  # aborted while queued: closed at the end


def scheduler(running: int, waiting: int = 0, kv: float = 0.0) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv,
                          kv_cache_tokens_used=int(kv * 1000), num_tokens_waiting=waiting * 10,
                          num_tokens_waiting_raw=waiting * 10)


def iteration(generated: int, preemptions: int = 0) -> IterationStats:
    return IterationStats(num_scheduled_tokens=generated, num_prompt_tokens=0,
                          num_cached_prompt_tokens=0, num_generation_tokens=generated,
                          batch_size=generated, step_time=0.01, forward_time=0.01,
                          num_preemptions=preemptions, prefix_cache_queries=0,
                          prefix_cache_hits=0)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_history_one_row_per_second_with_idle_seconds_filled() -> None:
    clock = Clock(100.2)
    history = EngineHistory(window_s=10, clock=clock)
    history.record_step(scheduler(2, 1, 0.5), iteration(2))
    clock.now = 100.7
    history.record_step(scheduler(3, 0, 0.6), iteration(3, preemptions=1))
    history.record_step(scheduler(0), None)  # the engine went idle
    clock.now = 103.1  # 101 and 102 were idle
    history.record_step(scheduler(1), iteration(1))
    clock.now = 104.0
    rows = history.samples()
    col = {name: i for i, name in enumerate(SAMPLE_FIELDS)}
    assert [r[col["t"]] for r in rows] == [100, 101, 102, 103]
    assert [r[col["running"]] for r in rows] == [3, 0, 0, 1]  # the peak of each second
    assert [r[col["waiting"]] for r in rows] == [1, 0, 0, 0]
    assert [r[col["generation_tokens"]] for r in rows] == [5, 0, 0, 1]
    assert [r[col["preemptions"]] for r in rows] == [1, 0, 0, 0]
    assert history.total_preemptions == 1
    assert [r[col["t"]] for r in history.samples(since=101)] == [102, 103]
    clock.now = 200.5  # long idle: the window is full of idle seconds, none older
    assert [r[col["t"]] for r in history.samples()] == list(range(191, 200))


def test_history_latency_percentiles_over_the_window() -> None:
    clock = Clock(0.0)
    history = EngineHistory(window_s=60, clock=clock)
    base = compute_request_stats(PREEMPTED_ONCE, num_prompt_tokens=3, num_cached_tokens=0,
                                 counters=RequestCounters(num_preemptions=1))
    history.record_finished(base)
    latency = history.latency_percentiles()
    assert latency["ttft"] == {"p50": pytest.approx(1.1), "p90": pytest.approx(1.1),
                               "p99": pytest.approx(1.1), "count": 1}
    assert latency["itl"]["count"] == len(base.inter_token_latencies) == 3
    assert history.finished["length"] == 1
    clock.now = 61.0  # the request left the window
    assert history.latency_percentiles()["ttft"] == {"p50": None, "p90": None, "p99": None,
                                                     "count": 0}


def test_percentiles_nearest_rank() -> None:
    assert percentiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
