"""Dead-letter inspection and requeue.

Each partition has its own dead-letter stream (`RunKeys.all_deadletters`), in the
hash tag of the streams whose entries it takes, so requeue puts an entry's original
fields back on its source stream and removes it from the dead-letter stream in one
single-slot transaction: it is never lost or doubled by a crash in between. Listing
and requeue cover every partition; an entry id names a dead letter in any of them.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from broker.codec import decode
from broker.connection import as_str
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.messages import DeadLetter


async def list_dead_letters(
    redis: aioredis.Redis, keys: RunKeys, count: int = 100
) -> list[tuple[str, DeadLetter]]:
    return [(entry_id, letter) for _, entry_id, letter in await _letters(redis, keys, count)]


async def _letters(
    redis: aioredis.Redis, keys: RunKeys, count: int
) -> list[tuple[str, str, DeadLetter]]:
    """(dead-letter stream, entry id, letter) for up to `count` letters of each partition."""
    out = []
    for stream in keys.all_deadletters:
        for raw_id, fields in await redis.xrange(stream, count=count):
            entry_id = as_str(raw_id)
            try:
                letter = decode(fields, expect=DeadLetter)
            except DecodeError as exc:
                letter = DeadLetter(
                    stream, entry_id, f"unreadable dead letter: {exc}", dict(fields)
                )
            assert isinstance(letter, DeadLetter)
            out.append((stream, entry_id, letter))
    return out


async def requeue(redis: aioredis.Redis, keys: RunKeys, entry_ids: list[str]) -> int:
    """Move the named dead letters back to their source streams; return how many."""
    moved = 0
    wanted = set(entry_ids)
    for stream, entry_id, letter in await _letters(redis, keys, count=1_000_000):
        if entry_id not in wanted or letter.source_stream in keys.all_deadletters:
            continue
        async with redis.pipeline(transaction=True) as pipe:
            pipe.xadd(letter.source_stream, letter.fields)  # type: ignore[arg-type]
            pipe.xdel(stream, entry_id)
            await pipe.execute()
        moved += 1
    return moved
