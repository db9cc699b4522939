"""Dead-letter inspection and requeue.

Requeue puts an entry's original fields back on its source stream and removes
it from the dead-letter stream in one transaction, so it is never lost or
doubled by a crash in between.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from broker.codec import decode
from broker.errors import DecodeError
from broker.keys import RunKeys
from broker.messages import DeadLetter


async def list_dead_letters(
    redis: aioredis.Redis, keys: RunKeys, count: int = 100
) -> list[tuple[str, DeadLetter]]:
    out = []
    for raw_id, fields in await redis.xrange(keys.deadletter, count=count):
        entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        try:
            letter = decode(fields, expect=DeadLetter)
        except DecodeError as exc:
            letter = DeadLetter(
                keys.deadletter, entry_id, f"unreadable dead letter: {exc}", dict(fields)
            )
        assert isinstance(letter, DeadLetter)
        out.append((entry_id, letter))
    return out


async def requeue(redis: aioredis.Redis, keys: RunKeys, entry_ids: list[str]) -> int:
    """Move the named dead letters back to their source streams; return how many."""
    moved = 0
    letters = dict(await list_dead_letters(redis, keys, count=1_000_000))
    for entry_id in entry_ids:
        letter = letters.get(entry_id)
        if letter is None or letter.source_stream == keys.deadletter:
            continue
        async with redis.pipeline(transaction=True) as pipe:
            pipe.xadd(letter.source_stream, letter.fields)  # type: ignore[arg-type]
            pipe.xdel(keys.deadletter, entry_id)
            await pipe.execute()
        moved += 1
    return moved
