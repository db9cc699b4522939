"""Riding out a Redis outage: exponential backoff between retries of a failed operation.

The broker translates every connection error and timeout into `RedisUnavailable`; a
long-running role (worker, learner) catches that name around each Redis operation of
its loop, waits with `Backoff`, and tries again, instead of ending. Nothing is lost
meanwhile: an entry stays pending until the commit that acks it succeeds, and a
commit retried after a lost reply is a no-op (consumers record committed message ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from broker.errors import BrokerError, RedisUnavailable

T = TypeVar("T")

log = logging.getLogger(__name__)


class Backoff:
    """Delays of `initial_s` doubling to `max_s`; `reset()` after a success."""

    def __init__(self, what: str, initial_s: float = 0.1, max_s: float = 5.0) -> None:
        self.what = what
        self.initial_s = initial_s
        self.max_s = max_s
        self.delay = initial_s
        self.failures = 0  # consecutive failures since the last success

    def reset(self) -> None:
        if self.failures:
            log.info("%s: Redis is back after %d failed attempts", self.what, self.failures)
        self.delay = self.initial_s
        self.failures = 0

    async def wait(self, exc: BrokerError, stop: asyncio.Event | None = None) -> None:
        """Log the failure and sleep the next delay (less if `stop` is set meanwhile)."""
        self.failures += 1
        log.warning("%s failed (%s); retrying in %.1fs", self.what, exc, self.delay)
        if stop is None:
            await asyncio.sleep(self.delay)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.delay)
        self.delay = min(self.delay * 2, self.max_s)


async def retry_while_unavailable(
    op: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event | None = None
) -> T:
    """Run `op` until it succeeds, backing off while Redis is unavailable.

    Only `RedisUnavailable` is retried. Once `stop` is set, the next failure is raised.
    """
    backoff = Backoff(what)
    while True:
        try:
            result = await op()
        except RedisUnavailable as exc:
            if stop is not None and stop.is_set():
                raise
            await backoff.wait(exc, stop)
            continue
        backoff.reset()
        return result
