"""Publishing to streams: pipelined XADD with a retention policy.

One `publish` call sends all its entries in a single pipeline round trip.
Retention trims approximately (``~``), which lets Redis drop whole macro-nodes
and keeps XADD O(1); MINID retention keeps a time window instead of a count.
With `wait_replicas` the pipeline ends with WAIT (`broker.replication`): a publish
returns once that many replicas hold it, or after the timeout with a warning (the
entries are on the master then; raising would make a retry publish them twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from broker.codec import encode
from broker.connection import redis_errors
from broker.messages import Message
from broker.metrics import PUBLISHED
from broker.replication import queue_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """How much of a stream to keep."""

    mode: Literal["none", "maxlen", "minid"] = "maxlen"
    maxlen: int = 100_000  # entries kept (approximately) in "maxlen" mode
    max_age_s: float = 86_400.0  # window kept in "minid" mode

    def __post_init__(self) -> None:
        if self.maxlen < 1 or self.max_age_s <= 0:
            raise ValueError("retention bounds must be positive")

    def xadd_kwargs(self) -> dict[str, object]:
        if self.mode == "maxlen":
            return {"maxlen": self.maxlen, "approximate": True}
        if self.mode == "minid":
            return {"minid": f"{int((time.time() - self.max_age_s) * 1000)}-0", "approximate": True}
        return {}


class Producer:
    """Appends encoded messages to streams."""

    def __init__(
        self,
        redis: aioredis.Redis,
        retention: Retention | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self._redis = redis
        self._retention = retention or Retention()
        self._wait = (wait_replicas, wait_timeout_ms)  # replicas a publish must reach (WAIT)

    async def publish(self, stream: str, messages: Sequence[Message]) -> list[str]:
        """Append every message in one round trip; return their entry ids in order."""
        return await self.publish_raw(stream, [encode(m) for m in messages])

    async def publish_raw(self, stream: str, entries: Sequence[dict[bytes, bytes]]) -> list[str]:
        """Append already-encoded entries (replay and dead-letter requeue use this)."""
        if not entries:
            return []
        kwargs = self._retention.xadd_kwargs()
        with redis_errors(f"publish to {stream}"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for fields in entries:
                    pipe.xadd(stream, fields, **kwargs)  # type: ignore[arg-type]
                if self._wait[0]:
                    queue_wait(pipe, self._redis, stream, *self._wait)
                ids = await pipe.execute()
            if self._wait[0] and int(reached := ids.pop()) < self._wait[0]:
                # Published all the same: new entries are not idempotent, so a retry would
                # publish them twice. Only while a shard has lost its replica.
                log.warning(
                    "publish to %s reached %s of %d replicas", stream, reached, self._wait[0]
                )
        PUBLISHED.labels(stream=stream).inc(len(ids))
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
