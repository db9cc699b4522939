"""The published policy version: the latest in a hash, every one in a stream.

Only versions that every inference server has confirmed are published, so a
reader of `current_policy` never believes a version nobody serves.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from broker.codec import decode, encode
from broker.connection import redis_errors
from broker.keys import RunKeys
from broker.messages import PolicyVersion

# The newest versions kept in the events stream (a record for `broker tail policy`; the hash
# holds the current one). Small, so that a long run's Redis stops growing within minutes.
POLICY_EVENTS_KEPT = 1_000


async def publish_policy(redis: aioredis.Redis, keys: RunKeys, policy: PolicyVersion) -> None:
    fields = encode(policy)
    with redis_errors(f"publishing policy version {policy.version}"):
        async with redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.policy_version)
            pipe.hset(keys.policy_version, mapping=fields)  # type: ignore[arg-type]
            pipe.xadd(keys.policy_events, fields, maxlen=POLICY_EVENTS_KEPT, approximate=True)  # type: ignore[arg-type]
            await pipe.execute()


async def current_policy(redis: aioredis.Redis, keys: RunKeys) -> PolicyVersion | None:
    with redis_errors("reading the policy version"):
        fields = await redis.hgetall(keys.policy_version)
    if not fields:
        return None
    message = decode(fields, expect=PolicyVersion)
    assert isinstance(message, PolicyVersion)
    return message
