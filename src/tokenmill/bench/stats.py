"""Every figure of a run, computed once from the request records.

Definitions (latencies in milliseconds):

- requests ok / failed / cut off: by ``RequestRecord.status``;
- duration: first send -> last request ended (or the deadline of a duration run);
- request throughput: ok requests / duration;
- output throughput: output tokens of *all* requests (partial ones included) / duration;
- total token throughput: (prompt tokens of requests that received a token, plus all
  output tokens) / duration;
- TTFT and ITL: over ok and cut-off requests (a duration run's cut-off requests are
  its steady state; leaving them out would keep only the earliest ones). A cut-off
  request that got no token has no TTFT. ITL pools the per-token samples;
- TPOT and E2EL: over ok requests only (they need the request's end);
- tokens per chunk: over every chunk that carried a token, of all requests (above 1
  when the server commits several tokens per step, as with speculative decoding);
- failed requests give no latency samples (their timing is that of the failure);
- goodput: ok requests meeting every given SLO (TTFT, TPOT, E2EL <= limit) / duration;
  a request with fewer than 2 tokens has no TPOT and meets a TPOT SLO.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from tokenmill.bench.counting import method_is_informative
from tokenmill.bench.records import RequestRecord, Status

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class Summary:
    num_ok: int
    num_failed: int
    num_cut_off: int
    duration_s: float
    request_throughput: float  # ok requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    mean_tokens_per_chunk: float | None  # None when no chunk carried a token
    max_tokens_per_chunk: int | None
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    goodput_slos_ms: dict[str, float]
    counting_method: str  # the one method used, "mixed", or "none"
    counting_methods: dict[str, int]  # method -> requests counted with it
    # CPUs' worth of CPU time the load generator itself used while it ran (its process's
    # CPU seconds / duration_s): on a host it shares with the server, the cores it took
    client_cpus: float | None = None


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty ascending values, linearly interpolated."""
    assert sorted_values, "percentile of no values"
    position = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def distribution(values_s: list[float]) -> Distribution:
    """Mean and percentiles of durations given in seconds, in milliseconds."""
    if not values_s:
        return Distribution(0, None, None, None, None)
    ms = sorted(v * 1000.0 for v in values_s)
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Distribution(len(ms), sum(ms) / len(ms), p50, p90, p99)


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2e_s}
    for key, limit_ms in slos_ms.items():
        value = measured[key]
        if value is None and key == "tpot":
            continue
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def summarize(records: list[RequestRecord], duration_s: float,
              slos_ms: dict[str, float], client_cpu_s: float | None = None) -> Summary:
    assert duration_s > 0, "a run takes time"
    ok = [r for r in records if r.status is Status.OK]
    timed = [r for r in records if r.status in (Status.OK, Status.CUT_OFF)]
    statuses = Counter(r.status for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records if r.status is Status.OK or r.chunks)
    output_tokens = sum(r.output_tokens for r in records)
    methods = Counter(r.counting_method.value for r in records if method_is_informative(r))
    overall = "none" if not methods else next(iter(methods)) if len(methods) == 1 else "mixed"
    chunk_tokens = [k for r in records for _, k in r.chunks]
    goodput = None
    if slos_ms:
        goodput = sum(meets_slos(r, slos_ms) for r in ok) / duration_s
    return Summary(
        num_ok=len(ok), num_failed=statuses[Status.FAILED],
        num_cut_off=statuses[Status.CUT_OFF], duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        total_prompt_tokens=prompt_tokens, total_output_tokens=output_tokens,
        ttft_ms=distribution([r.ttft_s for r in timed if r.ttft_s is not None]),
        tpot_ms=distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=distribution([s for r in timed for s in r.itl_s]),
        e2el_ms=distribution([r.e2e_s for r in ok]),
        mean_tokens_per_chunk=(sum(chunk_tokens) / len(chunk_tokens) if chunk_tokens else None),
        max_tokens_per_chunk=max(chunk_tokens, default=None),
        goodput=goodput, goodput_slos_ms=dict(slos_ms),
        counting_method=overall, counting_methods=dict(methods),
        client_cpus=None if client_cpu_s is None else client_cpu_s / duration_s,
    )
