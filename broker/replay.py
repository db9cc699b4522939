"""Replay: re-publish archived segments or a live stream's range, in order.

Sources yield ``(entry_id, fields)`` in stream order; a `ReplayFilter` selects
by id range, time, policy version or environment; `replay` republishes the
raw fields (bit-identical bodies) into a target stream at a chosen rate or as
fast as possible. The learner reads the same sources to train from history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from broker.archive import Archive, Entry, SegmentInfo, entry_facts, id_key
from broker.connection import as_str
from broker.producer import Producer


@dataclass(frozen=True)
class ReplayFilter:
    """Which entries to replay; every bound is inclusive and optional."""

    start_id: str | None = None
    end_id: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    min_version: int | None = None
    max_version: int | None = None
    env: str | None = None

    @property
    def needs_body(self) -> bool:
        return self.min_version is not None or self.max_version is not None or self.env is not None

    def admits(self, entry_id: str, fields: dict[bytes, bytes]) -> bool:
        key = id_key(entry_id)
        if self.start_id is not None and key < id_key(self.start_id):
            return False
        if self.end_id is not None and key > id_key(self.end_id):
            return False
        facts = entry_facts(entry_id, fields) if self.needs_body else None
        ms = key[0]
        if self.since_ms is not None and ms < self.since_ms:
            return False
        if self.until_ms is not None and ms > self.until_ms:
            return False
        if facts is None:
            return True
        if self.min_version is not None and (
            facts.version is None or facts.version < self.min_version
        ):
            return False
        if self.max_version is not None and (
            facts.version is None or facts.version > self.max_version
        ):
            return False
        return self.env is None or facts.env == self.env

    def may_overlap(self, seg: SegmentInfo) -> bool:
        """Cheap test on the index, so whole segments can be skipped unread."""
        if self.start_id is not None and id_key(seg.last_id) < id_key(self.start_id):
            return False
        if self.end_id is not None and id_key(seg.first_id) > id_key(self.end_id):
            return False
        if self.since_ms is not None and seg.last_ms < self.since_ms:
            return False
        if self.until_ms is not None and seg.first_ms > self.until_ms:
            return False
        if self.min_version is not None and (seg.max_version or -1) < self.min_version:
            return False
        if (
            self.max_version is not None
            and seg.min_version is not None
            and seg.min_version > self.max_version
        ):
            return False
        return self.env is None or self.env in seg.envs


def archive_entries(archive: Archive, flt: ReplayFilter | None = None) -> Iterable[Entry]:
    flt = flt or ReplayFilter()
    segments = [s for s in archive.segments if flt.may_overlap(s)]
    return (e for e in archive.entries(segments) if flt.admits(*e))


async def stream_entries(
    redis: aioredis.Redis, stream: str, flt: ReplayFilter | None = None, page: int = 1000
) -> AsyncIterator[Entry]:
    """A live stream's range through XRANGE, page by page."""
    flt = flt or ReplayFilter()
    cursor = flt.start_id or (f"{flt.since_ms}-0" if flt.since_ms is not None else "-")
    inclusive = True
    end = flt.end_id or (
        f"{flt.until_ms}-18446744073709551615" if flt.until_ms is not None else "+"
    )
    while True:
        low = cursor if inclusive else f"({cursor}"
        rows = await redis.xrange(stream, min=low, max=end, count=page)
        if not rows:
            return
        for raw_id, fields in rows:
            cursor = as_str(raw_id)
            if flt.admits(cursor, fields):
                yield cursor, dict(fields)
        inclusive = False


async def _aiter(source: Iterable[Entry] | AsyncIterator[Entry]) -> AsyncIterator[Entry]:
    if isinstance(source, AsyncIterator):
        async for item in source:
            yield item
    else:
        for item in source:
            yield item


async def replay(
    redis: aioredis.Redis,
    source: Iterable[Entry] | AsyncIterator[Entry],
    target: str,
    *,
    rate: float | None = None,
    batch: int = 256,
) -> int:
    """Publish every entry of `source` into `target` in order; `rate` is entries/s
    (None: as fast as possible). Returns the number published."""
    producer = Producer(redis)
    started = time.monotonic()
    pending: list[dict[bytes, bytes]] = []
    sent = 0
    step = batch if rate is None else max(1, min(batch, int(rate // 10) or 1))
    async for _, fields in _aiter(source):
        pending.append(fields)
        if len(pending) >= step:
            sent += len(await producer.publish_raw(target, pending))
            pending = []
            if rate is not None:
                await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))
    if pending:
        sent += len(await producer.publish_raw(target, pending))
    return sent
