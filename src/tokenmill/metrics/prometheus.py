"""Prometheus exporter: scheduler/iteration records and finished-request stats -> /metrics.

Every metric is declared once, in ``METRICS``; the constructor builds them from that
table, each in this instance's own registry and with the label ``model_name``. A row
may name a vLLM alias; with ``vllm_names=True`` the same value is also exported under
that name, so dashboards and autoscalers written for vLLM work unchanged.

Invariants:

- Counter names in the table end in ``_total``, as exposed; prometheus_client strips
  that suffix on construction and appends it again on exposition.
- Gauges hold the last ``SchedulerStats`` recorded: they change on the step where the
  state changes and read 0 as soon as a zero record arrives.
- ``request_success_total`` and ``admission_rejections_total`` pre-create every known
  label value at 0, so ``rate()`` works before the first event.
- Outside the table, ``tokenmill_process_resident_memory_bytes`` is read from ``/proc``
  at each scrape (``metrics.process_memory``): this process as ``http``, and the engine
  process as ``engine`` when its pid is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import prometheus_client as prom

from tokenmill.core.records import FinishReason, IterationStats, SchedulerStats
from tokenmill.metrics.process_memory import ProcessMemoryCollector
from tokenmill.metrics.stats import RequestStats

REJECTION_REASONS = ("max_num_queued_requests", "max_num_queued_tokens")


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` inclusive."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITERATION_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                           4096.0, 8192.0, 16384.0)
# fmt: on
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                           1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_COUNT_BUCKETS = _one_two_five(1_000_000)
PREEMPTION_BUCKETS = (0.0, *_one_two_five(100))
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric; ``key`` is how the record methods refer to it."""

    key: str
    kind: type[prom.Gauge] | type[prom.Counter] | type[prom.Histogram]
    name: str
    vllm_name: str | None
    doc: str
    label: str | None = None  # a second label besides model_name
    buckets: tuple[float, ...] = ()


_G, _C, _H = prom.Gauge, prom.Counter, prom.Histogram

# fmt: off
METRICS: tuple[MetricSpec, ...] = (
    # gauges: the scheduler's state after the latest step
    MetricSpec("running", _G, "tokenmill_num_requests_running", "vllm:num_requests_running",
               "Requests in the running batch."),
    MetricSpec("waiting", _G, "tokenmill_num_requests_waiting", "vllm:num_requests_waiting",
               "Requests in the waiting queue (new and preempted)."),
    MetricSpec("kv_usage", _G, "tokenmill_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
               "Used KV-cache blocks / total blocks (0..1)."),
    MetricSpec("kv_tokens", _G, "tokenmill_kv_cache_tokens_used", None,
               "Used KV-cache blocks * block size (tokens)."),
    MetricSpec("tokens_waiting", _G, "tokenmill_num_tokens_waiting", None,
               "Tokens waiting requests must compute before their next output, "
               "less expected prefix-cache hits."),
    MetricSpec("tokens_waiting_raw", _G, "tokenmill_num_tokens_waiting_raw", None,
               "Tokens waiting requests must compute, without the prefix-cache deduction."),
    # counters: summed over engine steps
    MetricSpec("prompt_tokens", _C, "tokenmill_prompt_tokens_total", "vllm:prompt_tokens_total",
               "Prompt tokens of requests that committed their first token."),
    MetricSpec("cached_prompt_tokens", _C, "tokenmill_prompt_tokens_cached_total", None,
               "Of those prompt tokens, the ones served by the prefix cache."),
    MetricSpec("generation_tokens", _C, "tokenmill_generation_tokens_total",
               "vllm:generation_tokens_total", "Tokens committed to requests' outputs."),
    MetricSpec("preemptions", _C, "tokenmill_num_preemptions_total",
               "vllm:num_preemptions_total",
               "Preemptions (a running request evicted to free KV blocks)."),
    MetricSpec("prefix_queries", _C, "tokenmill_prefix_cache_queries_total",
               "vllm:prefix_cache_queries_total", "Tokens looked up in the prefix cache."),
    MetricSpec("prefix_hits", _C, "tokenmill_prefix_cache_hits_total",
               "vllm:prefix_cache_hits_total", "Looked-up tokens found in the prefix cache."),
    MetricSpec("spec_drafts", _C, "tokenmill_spec_decode_num_drafts_total",
               "vllm:spec_decode_num_drafts_total",
               "Speculative verifications: one per request per step that verified drafts."),
    MetricSpec("spec_draft_tokens", _C, "tokenmill_spec_decode_num_draft_tokens_total",
               "vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified."),
    MetricSpec("spec_accepted_tokens", _C, "tokenmill_spec_decode_num_accepted_tokens_total",
               "vllm:spec_decode_num_accepted_tokens_total",
               "Draft tokens accepted (committed as sampled by the model)."),
    MetricSpec("grammar_compilations", _C, "tokenmill_grammar_compilations_total", None,
               "Grammars compiled for structured outputs and tool calls (cache misses; "
               "failed compilations included)."),
    MetricSpec("success", _C, "tokenmill_request_success_total", "vllm:request_success_total",
               "Finished requests by finish reason.", label="finished_reason"),
    MetricSpec("rejections", _C, "tokenmill_admission_rejections_total", None,
               "Requests refused with 503 by admission control, by the cap hit.", label="reason"),
    # histograms: one observation per finished request unless stated
    MetricSpec("ttft", _H, "tokenmill_time_to_first_token_seconds",
               "vllm:time_to_first_token_seconds",
               "First token emitted - request arrived.", buckets=TTFT_BUCKETS),
    MetricSpec("itl", _H, "tokenmill_inter_token_latency_seconds",
               "vllm:inter_token_latency_seconds",
               "Gap between token steps / tokens in the step (one sample per token).",
               buckets=TOKEN_LATENCY_BUCKETS),
    MetricSpec("tpot", _H, "tokenmill_request_time_per_output_token_seconds",
               "vllm:request_time_per_output_token_seconds",
               "(Last emitted - first emitted) / (tokens - 1).", buckets=TOKEN_LATENCY_BUCKETS),
    MetricSpec("e2e", _H, "tokenmill_e2e_request_latency_seconds",
               "vllm:e2e_request_latency_seconds",
               "Last response handed over - request arrived.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("queue", _H, "tokenmill_request_queue_time_seconds",
               "vllm:request_queue_time_seconds",
               "First scheduled - first queued.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("prefill", _H, "tokenmill_request_prefill_time_seconds",
               "vllm:request_prefill_time_seconds",
               "First token committed - first scheduled.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("decode", _H, "tokenmill_request_decode_time_seconds",
               "vllm:request_decode_time_seconds",
               "Last token committed - first token committed.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("inference", _H, "tokenmill_request_inference_time_seconds",
               "vllm:request_inference_time_seconds",
               "Last token committed - first scheduled.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricSpec("prompt_len", _H, "tokenmill_request_prompt_tokens", "vllm:request_prompt_tokens",
               "Prompt length of finished requests (tokens).", buckets=TOKEN_COUNT_BUCKETS),
    MetricSpec("generation_len", _H, "tokenmill_request_generation_tokens",
               "vllm:request_generation_tokens",
               "Generated length of finished requests (tokens).", buckets=TOKEN_COUNT_BUCKETS),
    MetricSpec("preemptions_per_request", _H, "tokenmill_request_num_preemptions", None,
               "Preemptions a finished request went through.", buckets=PREEMPTION_BUCKETS),
    MetricSpec("iteration_tokens", _H, "tokenmill_iteration_tokens", "vllm:iteration_tokens_total",
               "Tokens computed per engine step (prompt chunks + decodes).",
               buckets=ITERATION_TOKEN_BUCKETS),
    MetricSpec("step_time", _H, "tokenmill_engine_step_seconds", None,
               "Engine step duration: schedule + forward + update.", buckets=STEP_BUCKETS),
    MetricSpec("grammar_compile", _H, "tokenmill_grammar_compile_seconds", None,
               "Time to compile one grammar (on the engine's compile thread, off its step).",
               buckets=GRAMMAR_COMPILE_BUCKETS),
    MetricSpec("params_n", _H, "tokenmill_request_params_n", "vllm:request_params_n",
               "The n parameter of API requests.", buckets=PARAMS_N_BUCKETS),
    MetricSpec("params_max_tokens", _H, "tokenmill_request_params_max_tokens",
               "vllm:request_params_max_tokens",
               "The max_tokens parameter of API requests that set it.",
               buckets=TOKEN_COUNT_BUCKETS),
)
# fmt: on

_PRESET_LABELS = {
    "success": tuple(r.value for r in FinishReason),
    "rejections": REJECTION_REASONS,
}


class PrometheusMetrics:
    """Owns one registry; ``render()`` is the body of ``GET /metrics``."""

    def __init__(
        self,
        model_name: str,
        registry: prom.CollectorRegistry | None = None,
        vllm_names: bool = False,
        engine_pid: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        # key -> the exported metrics carrying that value (tokenmill, then the vLLM alias)
        self._metrics: dict[str, list[prom.metrics.MetricWrapperBase]] = {}
        # key -> their model_name children, for metrics with no second label (the hot path)
        self._plain: dict[str, list] = {}
        for spec in METRICS:
            names = [spec.name]
            if vllm_names and spec.vllm_name is not None:
                names.append(spec.vllm_name)
            self._metrics[spec.key] = [self._declare(spec, name) for name in names]
            if spec.label is None:
                self._plain[spec.key] = self._children(spec.key)
        pids = {"http": os.getpid()} | ({} if engine_pid is None else {"engine": engine_pid})
        self.registry.register(ProcessMemoryCollector(model_name, pids))

    def _declare(self, spec: MetricSpec, name: str) -> prom.metrics.MetricWrapperBase:
        labels = ["model_name"] + ([spec.label] if spec.label else [])
        kwargs = {"buckets": spec.buckets} if spec.kind is prom.Histogram else {}
        metric = spec.kind(name, spec.doc, labels, registry=self.registry, **kwargs)
        for value in _PRESET_LABELS.get(spec.key, ()):
            metric.labels(self.model_name, value)
        return metric

    def _children(self, key: str, *label_values: str) -> list:
        return [m.labels(self.model_name, *label_values) for m in self._metrics[key]]

    def _set(self, key: str, value: float) -> None:
        for child in self._plain[key]:
            child.set(value)

    def _inc(self, key: str, value: float) -> None:
        if value:
            for child in self._plain[key]:
                child.inc(value)

    def _observe(self, key: str, value: float | None) -> None:
        if value is not None:
            for child in self._plain[key]:
                child.observe(value)

    def record_step(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        """Publish gauges; with ``iteration``, also count and observe what the step did.

        ``iteration=None`` republishes the gauges only (an idle engine, or cancellations
        handled between steps).
        """
        self._set("running", scheduler.num_running)
        self._set("waiting", scheduler.num_waiting)
        self._set("kv_usage", scheduler.kv_cache_usage)
        self._set("kv_tokens", scheduler.kv_cache_tokens_used)
        self._set("tokens_waiting", scheduler.num_tokens_waiting)
        self._set("tokens_waiting_raw", scheduler.num_tokens_waiting_raw)
        if iteration is None:
            return
        self._inc("prompt_tokens", iteration.num_prompt_tokens)
        self._inc("cached_prompt_tokens", iteration.num_cached_prompt_tokens)
        self._inc("generation_tokens", iteration.num_generation_tokens)
        self._inc("preemptions", iteration.num_preemptions)
        self._inc("prefix_queries", iteration.prefix_cache_queries)
        self._inc("prefix_hits", iteration.prefix_cache_hits)
        self._inc("spec_drafts", iteration.num_drafts)
        self._inc("spec_draft_tokens", iteration.num_draft_tokens)
        self._inc("spec_accepted_tokens", iteration.num_accepted_tokens)
        self._observe("iteration_tokens", iteration.num_scheduled_tokens)
        self._observe("step_time", iteration.step_time)
        self._inc("grammar_compilations", len(iteration.grammar_compile_times))
        for seconds in iteration.grammar_compile_times:
            self._observe("grammar_compile", seconds)

    def record_finished(self, stats: RequestStats) -> None:
        """Count a finished request (any reason, aborts included) and observe its stats."""
        assert stats.finish_reason is not None, "a finished request carries its finish reason"
        for child in self._children("success", stats.finish_reason.value):
            child.inc()
        self._observe("ttft", stats.time_to_first_token)
        for sample in stats.inter_token_latencies:
            self._observe("itl", sample)
        self._observe("tpot", stats.time_per_output_token)
        self._observe("e2e", stats.e2e_latency)
        self._observe("queue", stats.queue_time)
        self._observe("prefill", stats.prefill_time)
        self._observe("decode", stats.decode_time)
        self._observe("inference", stats.inference_time)
        self._observe("prompt_len", stats.num_prompt_tokens)
        self._observe("generation_len", stats.num_generation_tokens)
        self._observe("preemptions_per_request", stats.num_preemptions)

    def record_request_params(self, n: int, max_tokens: int | None) -> None:
        """Once per API request; ``max_tokens=None`` (unset) is not observed."""
        self._observe("params_n", n)
        self._observe("params_max_tokens", max_tokens)

    def record_rejection(self, reason: str) -> None:
        """Count one admission-control 503; ``reason`` is one of ``REJECTION_REASONS``."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; expected {REJECTION_REASONS}")
        for child in self._children("rejections", reason):
            child.inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for ``GET /metrics``."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
