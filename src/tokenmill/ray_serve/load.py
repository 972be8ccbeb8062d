"""A replica's token load: the scheduler's running sums, as its Prometheus gauges show them.

``TokenLoad`` is an engine step sink: it keeps the ``SchedulerStats`` of the latest step
(the record the gauges are set from) and hands Ray Serve the same numbers for autoscaling
and routing. ``token_load = kv_cache_tokens_used + num_tokens_waiting``.
"""

from __future__ import annotations

from tokenmill.core.records import IterationStats, SchedulerStats

KV_TOKENS = "kv_cache_tokens_used"
TOKENS_WAITING = "num_tokens_waiting"
TOKEN_LOAD = "token_load"


class TokenLoad:
    def __init__(self) -> None:
        self._latest: SchedulerStats | None = None

    def record_step(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        self._latest = scheduler  # one reference store: safe to read from any thread

    def stats(self) -> dict[str, int]:
        """``{kv_cache_tokens_used, num_tokens_waiting, token_load}``; zeros before any step."""
        latest = self._latest
        kv = latest.kv_cache_tokens_used if latest else 0
        waiting = latest.num_tokens_waiting if latest else 0
        return {KV_TOKENS: kv, TOKENS_WAITING: waiting, TOKEN_LOAD: kv + waiting}
