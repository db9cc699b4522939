"""Publishing to streams: pipelined XADD.

One `publish` call sends all its entries in a single pipeline round trip. Publishing
never trims: a MAXLEN on XADD would drop entries no consumer group has acknowledged
yet. Streams are kept to their bounds by `broker.trim`, which trims only what every
group has acknowledged. With `wait_replicas` the pipeline ends with WAIT (`broker.replication`): a publish
returns once that many replicas hold it, or after the timeout with a warning (the
entries are on the master then; raising would make a retry publish them twice).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from broker.codec import encode
from broker.connection import redis_errors
from broker.messages import Message
from broker.metrics import PUBLISHED
from broker.replication import queue_wait

log = logging.getLogger(__name__)


class Producer:
    """Appends encoded messages to streams."""

    def __init__(
        self,
        redis: aioredis.Redis,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self._redis = redis
        self._wait = (wait_replicas, wait_timeout_ms)  # replicas a publish must reach (WAIT)

    async def publish(self, stream: str, messages: Sequence[Message]) -> list[str]:
        """Append every message in one round trip; return their entry ids in order."""
        return await self.publish_raw(stream, [encode(m) for m in messages])

    async def publish_raw(self, stream: str, entries: Sequence[dict[bytes, bytes]]) -> list[str]:
        """Append already-encoded entries (replay and dead-letter requeue use this)."""
        if not entries:
            return []
        with redis_errors(f"publish to {stream}"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for fields in entries:
                    pipe.xadd(stream, fields)  # type: ignore[arg-type]
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
