"""Metrics exporters: the Prometheus /metrics body and the periodic log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.core.records import (
    FinishReason,
    IterationStats,
    RequestCounters,
    RequestEvent,
    RequestEventType,
    SchedulerStats,
)
from tokenmill.metrics.log import StatLogger
from tokenmill.metrics.prometheus import METRICS, PrometheusMetrics
from tokenmill.metrics.stats import compute_request_stats

MODEL = "smollm2"
E = RequestEventType
DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def sched(running=3, waiting=2, usage=0.25, kv_tokens=512, waiting_tokens=300, raw=400):
    return SchedulerStats(running, waiting, usage, kv_tokens, waiting_tokens, raw)


def iteration(**overrides) -> IterationStats:
    fields = dict(
        num_scheduled_tokens=40,
        num_prompt_tokens=32,
        num_cached_prompt_tokens=16,
        num_generation_tokens=5,
        batch_size=6,
        step_time=0.02,
        forward_time=0.015,
        num_preemptions=1,
        prefix_cache_queries=48,
        prefix_cache_hits=16,
    )
    fields.update(overrides)
    return IterationStats(**fields)


def finished_stats(reason=FinishReason.STOP):
    """TTFT 0.26 s, ITL samples 0.1 and 0.1, TPOT 0.105, e2e 0.5, 3 tokens."""
    events = [
        RequestEvent(E.ARRIVED, 0.0),
        RequestEvent(E.QUEUED, 0.02),
        RequestEvent(E.SCHEDULED, 0.05),
        RequestEvent(E.NEW_TOKENS, 0.25, 1),
        RequestEvent(E.EMITTED, 0.26, 1),
        RequestEvent(E.NEW_TOKENS, 0.35, 1),
        RequestEvent(E.EMITTED, 0.36, 1),
        RequestEvent(E.NEW_TOKENS, 0.45, 1),
        RequestEvent(E.EMITTED, 0.47, 1),
        RequestEvent(E.FINISHED, 0.45, finish_reason=reason),
        RequestEvent(E.FINISHED_EMITTED, 0.5),
    ]
    return compute_request_stats(
        events,
        num_prompt_tokens=7,
        num_cached_tokens=0,
        counters=RequestCounters(num_preemptions=2, model_forward_time=0.1),
    )


def scrape(metrics: PrometheusMetrics) -> dict[tuple[str, frozenset], float]:
    """Sample (name, labels without model_name) -> value; every sample must carry model_name."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL, s.name
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def family_types(metrics: PrometheusMetrics) -> dict[str, str]:
    body, _ = metrics.render()
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


def test_every_name_exported_with_its_type():
    types = family_types(PrometheusMetrics(MODEL))
    kinds = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}
    for spec in METRICS:
        family = spec.name.removesuffix("_total") if spec.kind.__name__ == "Counter" else spec.name
        assert types.get(family) == kinds[spec.kind.__name__], spec.name
    assert not any(name.startswith("vllm:") for name in types)


def test_step_sets_gauges_and_adds_counters():
    m = PrometheusMetrics(MODEL)
    m.record_step(sched(), iteration())
    m.record_step(sched(running=4, waiting=0, usage=0.5), iteration(num_scheduled_tokens=4))
    s = scrape(m)
    assert value(s, "tokenmill_num_requests_running") == 4
    assert value(s, "tokenmill_num_requests_waiting") == 0
    assert value(s, "tokenmill_kv_cache_usage_ratio") == 0.5
    assert value(s, "tokenmill_kv_cache_tokens_used") == 512
    assert value(s, "tokenmill_num_tokens_waiting") == 300
    assert value(s, "tokenmill_num_tokens_waiting_raw") == 400
    assert value(s, "tokenmill_prompt_tokens_total") == 64
    assert value(s, "tokenmill_prompt_tokens_cached_total") == 32
    assert value(s, "tokenmill_generation_tokens_total") == 10
    assert value(s, "tokenmill_num_preemptions_total") == 2
    assert value(s, "tokenmill_prefix_cache_queries_total") == 96
    assert value(s, "tokenmill_prefix_cache_hits_total") == 32
    assert value(s, "tokenmill_iteration_tokens_count") == 2
    assert value(s, "tokenmill_iteration_tokens_sum") == 44
    assert value(s, "tokenmill_iteration_tokens_bucket", le="1.0") == 0
    assert value(s, "tokenmill_iteration_tokens_bucket", le="8.0") == 1
    assert value(s, "tokenmill_engine_step_seconds_sum") == pytest.approx(0.04)


def test_zero_scheduler_record_drops_gauges_at_once_and_keeps_counters():
    m = PrometheusMetrics(MODEL)
    m.record_step(sched(), iteration())
    m.record_step(SchedulerStats(0, 0, 0.0, 0, 0, 0), None)  # every request cancelled
    s = scrape(m)
    for name in (
        "tokenmill_num_requests_running",
        "tokenmill_num_requests_waiting",
        "tokenmill_kv_cache_usage_ratio",
        "tokenmill_kv_cache_tokens_used",
        "tokenmill_num_tokens_waiting",
        "tokenmill_num_tokens_waiting_raw",
    ):
        assert value(s, name) == 0, name
    assert value(s, "tokenmill_generation_tokens_total") == 5
    assert value(s, "tokenmill_iteration_tokens_count") == 1  # the idle republish observes nothing


def test_finished_request_observations():
    m = PrometheusMetrics(MODEL)
    m.record_finished(finished_stats())
    s = scrape(m)
    assert value(s, "tokenmill_request_success_total", finished_reason="stop") == 1
    for reason in ("length", "abort", "error"):
        assert value(s, "tokenmill_request_success_total", finished_reason=reason) == 0
    ttft = "tokenmill_time_to_first_token_seconds"
    assert value(s, ttft + "_count") == 1
    assert value(s, ttft + "_sum") == pytest.approx(0.26)
    assert value(s, ttft + "_bucket", le="0.25") == 0
    assert value(s, ttft + "_bucket", le="0.5") == 1
    itl = "tokenmill_inter_token_latency_seconds"
    assert value(s, itl + "_count") == 2  # one observation per sample
    assert value(s, itl + "_sum") == pytest.approx(0.2)
    expected_sums = {
        "tokenmill_request_time_per_output_token_seconds": 0.105,
        "tokenmill_e2e_request_latency_seconds": 0.5,
        "tokenmill_request_queue_time_seconds": 0.03,
        "tokenmill_request_prefill_time_seconds": 0.2,
        "tokenmill_request_decode_time_seconds": 0.2,
        "tokenmill_request_inference_time_seconds": 0.4,
        "tokenmill_request_prompt_tokens": 7,
        "tokenmill_request_generation_tokens": 3,
        "tokenmill_request_num_preemptions": 2,
    }
    for name, total in expected_sums.items():
        assert value(s, name + "_count") == 1, name
        assert value(s, name + "_sum") == pytest.approx(total), name


def test_abort_before_scheduling_counts_but_observes_only_what_happened():
    events = [
        RequestEvent(E.ARRIVED, 0.0),
        RequestEvent(E.QUEUED, 0.1),
        RequestEvent(E.FINISHED, 1.0, finish_reason=FinishReason.ABORT),
        RequestEvent(E.FINISHED_EMITTED, 1.0),
    ]
    aborted = compute_request_stats(
        events,
        num_prompt_tokens=5,
        num_cached_tokens=0,
        counters=RequestCounters(),
    )
    m = PrometheusMetrics(MODEL)
    m.record_finished(aborted)
    s = scrape(m)
    assert value(s, "tokenmill_request_success_total", finished_reason="abort") == 1
    assert value(s, "tokenmill_time_to_first_token_seconds_count") == 0
    assert value(s, "tokenmill_request_queue_time_seconds_count") == 0
    assert value(s, "tokenmill_e2e_request_latency_seconds_count") == 1
    assert value(s, "tokenmill_request_prompt_tokens_sum") == 5


def test_request_params_and_rejections():
    m = PrometheusMetrics(MODEL)
    m.record_request_params(n=2, max_tokens=None)
    m.record_request_params(n=1, max_tokens=100)
    m.record_rejection("max_num_queued_tokens")
    s = scrape(m)
    assert value(s, "tokenmill_request_params_n_count") == 2
    assert value(s, "tokenmill_request_params_n_sum") == 3
    assert value(s, "tokenmill_request_params_max_tokens_count") == 1  # unset is not observed
    assert value(s, "tokenmill_request_params_max_tokens_sum") == 100
    rejections = "tokenmill_admission_rejections_total"
    assert value(s, rejections, reason="max_num_queued_tokens") == 1
    assert value(s, rejections, reason="max_num_queued_requests") == 0
    with pytest.raises(ValueError, match="rejection reason"):
        m.record_rejection("too_busy")


def test_vllm_names_carry_the_same_values_only_when_enabled():
    plain, both = PrometheusMetrics(MODEL), PrometheusMetrics(MODEL, vllm_names=True)
    for m in (plain, both):
        m.record_step(sched(), iteration())
        m.record_finished(finished_stats(FinishReason.LENGTH))
        m.record_request_params(n=2, max_tokens=16)
    s = scrape(both)
    aliased = [spec for spec in METRICS if spec.vllm_name]
    assert len(aliased) == 25
    for spec in aliased:
        for suffix in ("", "_bucket", "_count", "_sum"):
            ours = {lb: v for (n, lb), v in s.items() if n == spec.name + suffix}
            theirs = {lb: v for (n, lb), v in s.items() if n == spec.vllm_name + suffix}
            assert ours == theirs, spec.vllm_name + suffix
        assert any(n.startswith(spec.vllm_name) for n, _ in s), spec.vllm_name
    assert value(s, "vllm:num_requests_running") == 3
    assert value(s, "vllm:kv_cache_usage_perc") == 0.25
    assert value(s, "vllm:request_success_total", finished_reason="length") == 1
    assert value(s, "vllm:iteration_tokens_total_sum") == 40
    assert not any("tokens_waiting" in n for n, _ in s if n.startswith("vllm:"))
    assert not any(n.startswith("vllm:") for n, _ in scrape(plain))


def test_instances_do_not_share_state():
    a, b = PrometheusMetrics(MODEL), PrometheusMetrics(MODEL)
    a.record_step(sched(), iteration())
    assert value(scrape(b), "tokenmill_generation_tokens_total") == 0
    assert value(scrape(a), "tokenmill_generation_tokens_total") == 5


def test_docs_reference_every_metric():
    text = DOCS.read_text()
    for spec in METRICS:
        assert f"`{spec.name}`" in text, spec.name
        if spec.vllm_name:
            assert f"`{spec.vllm_name}`" in text, spec.vllm_name


def test_log_line_reports_rates_gauges_and_hit_rate(caplog):
    log = StatLogger(MODEL, interval_s=10.0, logger=logging.getLogger("tokenmill.test"), start_ts=0)
    log.record_step(sched(), iteration())
    log.record_step(sched(running=4, usage=0.375, waiting_tokens=1024), iteration())
    with caplog.at_level(logging.INFO, logger="tokenmill.test"):
        assert not log.maybe_log(9.9)
        assert log.maybe_log(10.0)
    assert [r.getMessage() for r in caplog.records] == [
        "smollm2: prompt 6.4 tok/s, generation 1.0 tok/s, running 4 reqs, waiting 2 reqs, "
        "tokens waiting 1024, KV cache 37.5%, prefix cache hit rate 33.3%, preemptions 2"
    ]


def test_log_line_per_interval_and_quiet_when_idle(caplog):
    log = StatLogger(MODEL, interval_s=5.0, logger=logging.getLogger("tokenmill.test"), start_ts=0)
    idle = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    with caplog.at_level(logging.INFO, logger="tokenmill.test"):
        log.record_step(sched(), iteration(prefix_cache_queries=0, prefix_cache_hits=0))
        assert log.maybe_log(5.0)
        log.record_step(idle, None)
        assert log.maybe_log(10.0)  # the first idle interval is logged ...
        assert not log.maybe_log(15.0)  # ... later ones are not
        log.record_step(sched(running=1, waiting=0), None)
        assert log.maybe_log(20.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "prompt 6.4 tok/s" in lines[0] and "hit rate n/a" in lines[0]
    assert "prompt 0.0 tok/s, generation 0.0 tok/s, running 0 reqs" in lines[1]
    assert "running 1 reqs, waiting 0 reqs" in lines[2]
