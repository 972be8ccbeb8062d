"""When to send requests: a closed loop (fixed concurrency) or an open loop (arrival rate).

``drive()`` knows nothing of HTTP: it calls ``run_one(index)`` for index 0, 1, ...
and decides when. The run is bounded by ``num_requests`` (no index at or past it is
started) and/or ``duration`` (no request starts after the deadline; those still
running then are cancelled, and the caller marks them cut off).

Open loop: the first request goes at once, then each next after a gap drawn from a
gamma distribution with shape ``burstiness`` and mean ``1 / request_rate`` (vLLM's
rule: burstiness 1 is a Poisson process, lower is burstier, higher is more regular).
``request_rate = inf`` sends every request at once. Arrival times come from their own
``random.Random(seed)``, so they do not depend on prompt generation.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable

from tokenmill.bench.config import BenchConfig

RunOne = Callable[[int], Awaitable[None]]


async def drive(config: BenchConfig, run_one: RunOne, start_ts: float) -> float:
    """Run the load of ``config``; return the run's duration in seconds from ``start_ts``.

    Invariant: when this returns, no request task is left running.
    """
    deadline = None if config.duration is None else start_ts + config.duration
    indices = itertools.count()

    def next_index() -> int | None:
        index = next(indices)
        if config.num_requests is not None and index >= config.num_requests:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        return index

    tasks: set[asyncio.Task] = set()
    if config.concurrency is not None:
        issuer = _closed_loop(config.concurrency, next_index, run_one, tasks)
    else:
        assert config.request_rate is not None
        gaps = arrival_gaps(config.request_rate, config.burstiness, config.seed)
        issuer = _open_loop(gaps, next_index, run_one, tasks)
    main = asyncio.create_task(issuer)
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        await asyncio.wait({main}, timeout=timeout)
        end_ts = time.perf_counter()
        if main.done():
            main.result()  # re-raise what a request raised (e.g. a setup error)
    finally:
        for task in (main, *tasks):
            task.cancel()
        await asyncio.gather(main, *tasks, return_exceptions=True)
    return end_ts - start_ts


async def _closed_loop(concurrency: int, next_index: Callable[[], int | None], run_one: RunOne,
                       tasks: set[asyncio.Task]) -> None:
    async def worker() -> None:
        while (index := next_index()) is not None:
            await run_one(index)

    tasks.update(asyncio.create_task(worker()) for _ in range(concurrency))
    await asyncio.gather(*tasks)


async def _open_loop(gaps: Callable[[], float], next_index: Callable[[], int | None],
                     run_one: RunOne, tasks: set[asyncio.Task]) -> None:
    next_ts = time.perf_counter()
    while (index := next_index()) is not None:
        task = asyncio.create_task(run_one(index))
        tasks.add(task)
        task.add_done_callback(_forget_if_ok(tasks))
        next_ts += gaps()
        await asyncio.sleep(max(0.0, next_ts - time.perf_counter()))
    await asyncio.gather(*tasks)


def _forget_if_ok(tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    """Drop finished tasks so a long run does not keep them all; keep failed ones to raise."""

    def callback(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            tasks.discard(task)

    return callback


def arrival_gaps(rate: float, burstiness: float, seed: int) -> Callable[[], float]:
    """Gap sampler: gamma(shape=burstiness, scale=1 / (rate * burstiness)); mean 1 / rate."""
    if rate == math.inf:
        return lambda: 0.0
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return lambda: rng.gammavariate(burstiness, scale)
