"""What a consumer group has not finished on a stream: entries undelivered and pending.

`group_backlog` counts them; `unfinished_entries` reads them (the pending ones by id,
then the undelivered ones in pages). The learner's admission count at start-up
(`learner.tasks.count_in_flight`) is built on these. Where Redis cannot tell a group's
lag (an entry deleted past its last delivery, or a failover), the entries past the
last delivery are counted in pages instead. Every read runs inside the broker's error
translation (`broker.connection.redis_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from broker.connection import as_str, redis_errors

Fields = dict[bytes, bytes]
_ID_BATCH = 500  # pending entries read by id per pipeline
_PAGE = 256  # undelivered entries per XRANGE page


@dataclass(frozen=True)
class Backlog:
    """A consumer group's unfinished entries on one stream."""

    undelivered: int  # entries past the group's last delivery (the whole stream: no group)
    pending: int  # delivered to a consumer, not acked
    last_delivered_id: str | None  # None when the group (or the stream) does not exist


async def _group_info(redis: aioredis.Redis, stream: str, group: str) -> dict[str, Any] | None:
    if not await redis.exists(stream):
        return None
    for info in await redis.xinfo_groups(stream):
        if as_str(info["name"]) == group:
            return info
    return None


async def _entries_after(redis: aioredis.Redis, stream: str, entry_id: str) -> int:
    """How many entries `stream` holds past `entry_id` (what a group would read next)."""
    count, low = 0, entry_id
    while True:
        rows = await redis.xrange(stream, min=f"({low}", max="+", count=_PAGE)
        count += len(rows)
        if len(rows) < _PAGE:
            return count
        low = as_str(rows[-1][0])


async def group_backlog(redis: aioredis.Redis, stream: str, group: str) -> Backlog:
    """The undelivered and pending entries of `group` on `stream`."""
    with redis_errors(f"reading group {group} of {stream}"):
        info = await _group_info(redis, stream, group)
        if info is None:
            return Backlog(int(await redis.xlen(stream)), 0, None)
        last = as_str(info["last-delivered-id"])
        lag = info.get("lag")
        undelivered = int(lag) if lag is not None else await _entries_after(redis, stream, last)
        return Backlog(undelivered, int(info.get("pending", 0)), last)


async def unfinished_entries(
    redis: aioredis.Redis, stream: str, group: str, last_delivered_id: str
) -> list[tuple[Any, Fields]]:
    """The entries of `stream` that `group` has pending, then those past its last delivery."""
    rows: list[tuple[Any, Fields]] = []
    with redis_errors(f"reading the unfinished entries of group {group} of {stream}"):
        pending = await redis.xpending_range(stream, group, min="-", max="+", count=1_000_000)
        ids = [as_str(p["message_id"]) for p in pending]
        for chunk in range(0, len(ids), _ID_BATCH):
            async with redis.pipeline(transaction=False) as pipe:
                for entry_id in ids[chunk : chunk + _ID_BATCH]:
                    pipe.xrange(stream, min=entry_id, max=entry_id)
                for found in await pipe.execute():
                    rows += found
        low = last_delivered_id
        while True:
            page = await redis.xrange(stream, min=f"({low}", max="+", count=_PAGE)
            rows += page
            if len(page) < _PAGE:
                return rows
            low = as_str(page[-1][0])
