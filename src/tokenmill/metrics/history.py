"""The engine's recent past, one sample per second, for the dashboard and ``/v1/engine/state``.

Standard library only. A step sink (``record_step``) and a finished-request sink
(``record_finished``), like the Prometheus exporter, but keeping a short history instead
of cumulative counters:

- ``samples``: for every whole second of the last ``window_s``, the scheduler's gauges
  at their highest during that second (so a request that came and went within it
  still shows) and the tokens and preemptions of its steps. A second with no step
  repeats the gauges the previous one ended with, and zero counts: no holes.
- latency percentiles (TTFT, ITL, TPOT, e2e) over the requests that finished in the
  last ``window_s``, the most recent ``max_samples`` values of each.

Seconds are ``int(clock())`` of a monotonic clock; the current second is not reported
until it is over. Reading is O(window + samples) and happens on request only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from tokenmill.core.records import FinishReason, IterationStats, SchedulerStats
from tokenmill.metrics.stats import RequestStats

PERCENTILES = (50, 90, 99)
SAMPLE_FIELDS = ("t", "running", "waiting", "tokens_waiting", "kv_cache_usage",
                 "kv_cache_tokens_used", "prompt_tokens", "generation_tokens", "preemptions")


class EngineHistory:
    """Not thread-safe: record and read on one thread (the server's event loop)."""

    def __init__(self, window_s: int = 300, max_samples: int = 20_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.latest = SchedulerStats()
        self.total_preemptions = 0
        self.finished = {reason.value: 0 for reason in FinishReason}
        # closed seconds: [second, last gauges, prompt tokens, generation tokens,
        # preemptions, peak gauges]
        self._seconds: deque[list] = deque(maxlen=window_s)
        self._open: list | None = None
        self._latency: dict[str, deque[tuple[float, float]]] = {
            name: deque(maxlen=max_samples) for name in ("ttft", "itl", "tpot", "e2e")}
        self._latency_version = 0  # changes whenever the latency samples do
        self._percentiles: tuple[int, dict] | None = None  # (version, result)

    # ------------------------------------------------------------ recording
    def record_step(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        second = int(self.clock())
        if self._open is None:
            self._open = [second, scheduler, 0, 0, 0, scheduler]
        self._roll(second)
        self.latest = scheduler
        self._open[1] = scheduler
        self._open[5] = _peak(self._open[5], scheduler)
        if iteration is not None:
            self._open[2] += iteration.num_prompt_tokens
            self._open[3] += iteration.num_generation_tokens
            self._open[4] += iteration.num_preemptions
            self.total_preemptions += iteration.num_preemptions

    def record_finished(self, stats: RequestStats) -> None:
        now = self.clock()
        self._latency_version += 1
        if stats.finish_reason is not None:
            self.finished[stats.finish_reason.value] += 1
        for name, value in (("ttft", stats.time_to_first_token),
                            ("tpot", stats.time_per_output_token), ("e2e", stats.e2e_latency)):
            if value is not None:
                self._latency[name].append((now, value))
        self._latency["itl"].extend((now, v) for v in stats.inter_token_latencies)

    def _roll(self, second: int) -> None:
        """Close the open second if ``second`` is later, fill the idle seconds in between
        with its gauges, and open ``second``."""
        if self._open is None or self._open[0] >= second:
            return
        closed = self._open
        self._seconds.append(closed)
        for idle in range(max(closed[0] + 1, second - self.window_s), second):
            self._seconds.append([idle, closed[1], 0, 0, 0, closed[1]])
        self._open = [second, closed[1], 0, 0, 0, closed[1]]

    # -------------------------------------------------------------- reading
    def samples(self, since: float | None = None) -> list[list]:
        """Closed seconds after ``since`` (a second as returned in ``t``), oldest first,
        as rows in the order of ``SAMPLE_FIELDS``."""
        now = int(self.clock())
        self._roll(now)
        first = now - self.window_s if since is None else max(now - self.window_s, since)
        return [[second, g.num_running, g.num_waiting, g.num_tokens_waiting,
                 round(g.kv_cache_usage, 4), g.kv_cache_tokens_used, prompt, generation, pre]
                for second, _, prompt, generation, pre, g in self._seconds if second > first]

    def latency_percentiles(self) -> dict[str, dict[str, float | None]]:
        """{metric: {"p50": s, "p90": s, "p99": s, "count": n}} over the window; computed
        again only when the samples changed, however often it is read."""
        horizon = self.clock() - self.window_s
        for values in self._latency.values():
            while values and values[0][0] < horizon:
                values.popleft()
                self._latency_version += 1
        if self._percentiles is None or self._percentiles[0] != self._latency_version:
            result = {name: {**percentiles(v for _, v in values), "count": len(values)}
                      for name, values in self._latency.items()}
            self._percentiles = (self._latency_version, result)
        return self._percentiles[1]


def _peak(a: SchedulerStats, b: SchedulerStats) -> SchedulerStats:
    return SchedulerStats(
        num_running=max(a.num_running, b.num_running),
        num_waiting=max(a.num_waiting, b.num_waiting),
        kv_cache_usage=max(a.kv_cache_usage, b.kv_cache_usage),
        kv_cache_tokens_used=max(a.kv_cache_tokens_used, b.kv_cache_tokens_used),
        num_tokens_waiting=max(a.num_tokens_waiting, b.num_tokens_waiting),
        num_tokens_waiting_raw=max(a.num_tokens_waiting_raw, b.num_tokens_waiting_raw))


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles ``PERCENTILES`` of ``values`` (None when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]
            for p in PERCENTILES}
