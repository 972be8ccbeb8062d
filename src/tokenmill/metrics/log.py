"""The periodic one-line engine summary in the server log.

``record_step`` accumulates what each step did; ``maybe_log(now)`` writes one line per
``interval_s`` with rates over the interval just ended and the latest gauges::

    smollm2: prompt 512.0 tok/s, generation 87.5 tok/s, running 4 reqs, waiting 2 reqs,
    tokens waiting 1024, KV cache 37.5%, prefix cache hit rate 50.0%, preemptions 0

(one line in the log; wrapped here). The hit rate is over the interval's lookups
("n/a" when there were none). With speculative decoding on, the line ends with
``, draft acceptance rate 62.5%``: accepted / verified draft tokens over the interval
("n/a" when no draft was verified). An idle engine logs one idle line, then stays quiet until
something happens. ``now`` and ``start_ts`` are ``time.monotonic()`` values.
"""

from __future__ import annotations

import logging
import time

from tokenmill.core.records import IterationStats, SchedulerStats


class StatLogger:
    """Accumulates step records between log lines; not thread-safe (one engine loop)."""

    def __init__(
        self,
        model_name: str,
        interval_s: float = 10.0,
        logger: logging.Logger = logging.getLogger("tokenmill"),  # noqa: B008
        *,
        start_ts: float | None = None,
        speculative: bool = False,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.model_name = model_name
        self.interval_s = interval_s
        self.logger = logger
        self.speculative = speculative
        self._last_log_ts = time.monotonic() if start_ts is None else start_ts
        self._scheduler = SchedulerStats()
        self._last_line_idle = False
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._draft_tokens = 0
        self._accepted_tokens = 0

    def record_step(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        """Keep the latest gauges; add the step's counts to the current interval."""
        self._scheduler = scheduler
        if iteration is not None:
            self._prompt_tokens += iteration.num_prompt_tokens
            self._generation_tokens += iteration.num_generation_tokens
            self._prefix_queries += iteration.prefix_cache_queries
            self._prefix_hits += iteration.prefix_cache_hits
            self._preemptions += iteration.num_preemptions
            self._draft_tokens += iteration.num_draft_tokens
            self._accepted_tokens += iteration.num_accepted_tokens

    def maybe_log(self, now: float) -> bool:
        """Log the summary if ``interval_s`` has passed since the last one; True if it did."""
        elapsed = now - self._last_log_ts
        if elapsed < self.interval_s:
            return False
        busy = self._scheduler.num_running or self._scheduler.num_waiting
        idle = not (busy or self._prompt_tokens or self._generation_tokens)
        logged = not (idle and self._last_line_idle)
        if logged:
            self.logger.info("%s", self._format_line(elapsed))
        self._last_line_idle = idle
        self._last_log_ts = now
        self._reset_interval()
        return logged

    def _format_line(self, elapsed: float) -> str:
        """The summary of the current interval, ``elapsed`` seconds long."""
        s = self._scheduler
        hit_rate = _percent(self._prefix_hits, self._prefix_queries)
        line = (
            f"{self.model_name}: prompt {self._prompt_tokens / elapsed:.1f} tok/s, "
            f"generation {self._generation_tokens / elapsed:.1f} tok/s, "
            f"running {s.num_running} reqs, waiting {s.num_waiting} reqs, "
            f"tokens waiting {s.num_tokens_waiting}, "
            f"KV cache {100.0 * s.kv_cache_usage:.1f}%, prefix cache hit rate {hit_rate}, "
            f"preemptions {self._preemptions}"
        )
        if self.speculative:
            line += f", draft acceptance rate {_percent(self._accepted_tokens, self._draft_tokens)}"
        return line


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"
