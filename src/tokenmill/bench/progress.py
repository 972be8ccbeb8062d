"""A progress bar on stderr while a run goes (rich), or nothing.

A run bounded by ``num_requests`` shows requests finished out of the total; a run
bounded only by ``duration`` shows seconds elapsed out of the duration, with the
count of finished requests in the description.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

TICK_S = 0.25


class RunProgress:
    def __init__(self, enabled: bool, num_requests: int | None, duration: float | None) -> None:
        self._enabled = enabled
        self._by_time = num_requests is None
        self._total = float(duration if self._by_time else num_requests)
        self._finished = 0
        self._progress: Progress | None = None
        self._ticker: asyncio.Task | None = None

    async def __aenter__(self) -> RunProgress:
        if not self._enabled:
            return self
        columns = [TextColumn("{task.description}"), BarColumn()]
        columns.append(TextColumn("{task.completed:.0f}/{task.total:.0f} s") if self._by_time
                       else MofNCompleteColumn())
        self._progress = Progress(*columns, TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=False)
        self._progress.start()
        self._task = self._progress.add_task(self._description(), total=self._total)
        if self._by_time:
            self._ticker = asyncio.create_task(self._tick(time.perf_counter()))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._progress is not None:
            if exc is None:
                self._progress.update(self._task, completed=self._total)
            self._progress.stop()

    def request_finished(self) -> None:
        self._finished += 1
        if self._progress is None:
            return
        self._progress.update(self._task, description=self._description())
        if not self._by_time:
            self._progress.advance(self._task)

    def _description(self) -> str:
        return f"bench ({self._finished} done)" if self._by_time else "bench"

    async def _tick(self, start_ts: float) -> None:
        assert self._progress is not None
        while True:
            elapsed = min(time.perf_counter() - start_ts, self._total)
            self._progress.update(self._task, completed=elapsed)
            await asyncio.sleep(TICK_S)
