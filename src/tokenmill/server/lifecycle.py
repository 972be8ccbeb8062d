"""The server's life after start-up: healthy or not, serving or draining.

``/health`` answers 503 once the engine has failed ``UNHEALTHY_AFTER_FAILURES`` steps
in a row (an orchestrator should restart the process) and while draining. Draining
(``drain``, on SIGTERM) refuses new requests with 503 and ``Retry-After``, lets those in
flight finish for up to ``shutdown_timeout`` seconds, then aborts the rest: each still
gets its response, with finish reason ``abort`` and its usage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from tokenmill.frontend.async_client import AsyncEngineClient

logger = logging.getLogger("tokenmill")

UNHEALTHY_AFTER_FAILURES = 3
_POLL_S = 0.05
_ABORT_GRACE_S = 5.0  # for aborted requests to send their last chunks


class ServerLifecycle:
    def __init__(self, engine: AsyncEngineClient, shutdown_timeout: float) -> None:
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    @property
    def retry_after(self) -> str:
        """Seconds a refused client should wait (``Retry-After``): the drain's length."""
        return str(max(1, math.ceil(self.shutdown_timeout)))

    def healthy(self) -> bool:
        return (not self.draining
                and self.engine.consecutive_failures < UNHEALTHY_AFTER_FAILURES)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def start_drain(self, then: Callable[[], None]) -> bool:
        """From any thread: stop admission now, drain on the server's loop, then call
        ``then`` there. False when there is nothing to drain yet (no loop) or a drain
        already runs."""
        if self.loop is None or self.draining:
            return False
        self.draining = True
        asyncio.run_coroutine_threadsafe(self._drain_then(then), self.loop)
        return True

    async def _drain_then(self, then: Callable[[], None]) -> None:
        try:
            await self.drain()
        finally:
            then()

    async def drain(self) -> None:
        """Stop admission, wait for requests in flight, then abort what is left."""
        self.draining = True
        logger.info("draining: %d request(s) in flight, up to %.1f s",
                    self.engine.num_in_flight, self.shutdown_timeout)
        if not await self._wait_idle(self.shutdown_timeout):
            logger.info("shutdown timeout: aborting %d request(s)", self.engine.num_in_flight)
            self.engine.abort_all()
            await self._wait_idle(_ABORT_GRACE_S)

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.engine.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True
