"""The staleness/admission budget, held in Redis so it binds every process.

Staleness is bounded by admission, not by discarding: the learner sets the
limit to ``(max_staleness + 1) * groups_per_batch`` and acquires a slot per task
it issues, passing what it already buffers as ``reserve``; a slot is released
once the task's group has been consumed. Acquire and release are single Lua
scripts, so any number of processes can use the budget at once and the count
of slots in flight never exceeds the limit. While a stream is over its bounds the trimmer
holds the limit lower (`hold`, `broker.trim`). With ``wait_replicas`` (a replicated
Redis or a cluster) each acquire and release is followed by WAIT on its connection,
so a failover does not roll the count back under the tasks already published.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from broker.connection import as_str, redis_errors
from broker.errors import BudgetError
from broker.keys import RunKeys
from broker.metrics import ADMISSION_HELD, ADMISSION_IN_FLIGHT, ADMISSION_LIMIT
from broker.replication import queue_wait

log = logging.getLogger(__name__)

# KEYS[1] = budget hash; ARGV[1] = wanted, ARGV[2] = reserve. Returns granted.
# A hold (`held_limit`) lowers the limit while a stream is over its bounds (broker.trim).
_ACQUIRE = """
local limit = tonumber(redis.call('HGET', KEYS[1], 'limit') or '0')
local held = redis.call('HGET', KEYS[1], 'held_limit')
if held then limit = math.min(limit, tonumber(held)) end
local in_flight = tonumber(redis.call('HGET', KEYS[1], 'in_flight') or '0')
local grant = math.min(tonumber(ARGV[1]), limit - tonumber(ARGV[2]) - in_flight)
if grant <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'in_flight', grant)
return grant
"""

# KEYS[1] = budget hash; ARGV[1] = n. Returns the new in_flight, or -1 on over-release.
_RELEASE = """
local in_flight = tonumber(redis.call('HGET', KEYS[1], 'in_flight') or '0')
local n = tonumber(ARGV[1])
if n > in_flight then
  redis.call('HSET', KEYS[1], 'in_flight', 0)
  return -1
end
return redis.call('HINCRBY', KEYS[1], 'in_flight', -n)
"""


class AdmissionBudget:
    """A counting semaphore in Redis with a settable limit."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self._redis = redis
        self._key = keys.admission
        self._acquire = redis.register_script(_ACQUIRE)
        self._release = redis.register_script(_RELEASE)
        self._wait = (wait_replicas, wait_timeout_ms)

    async def _run(self, script: AsyncScript, args: list[int]) -> int:
        """Run an admission script; with wait_replicas, WAIT on the same connection."""
        if not self._wait[0]:
            return int(await script(keys=[self._key], args=args))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.eval(script.script, 1, self._key, *args)  # type: ignore[arg-type]
            queue_wait(pipe, self._redis, self._key, *self._wait)
            result, reached = await pipe.execute()
        if int(reached) < self._wait[0]:
            # Applied all the same: a retry would count the slots twice. Only while the
            # shard has lost its replica.
            log.warning("admission update reached %s of %d replicas", reached, self._wait[0])
        return int(result)

    async def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise BudgetError(f"admission limit must be >= 1, got {limit}")
        with redis_errors("setting the admission limit"):
            await self._redis.hset(self._key, "limit", limit)
        ADMISSION_LIMIT.set(limit)

    async def reset(self) -> None:
        """Forget every slot in flight (a fresh run, or a resumed learner re-counting)."""
        with redis_errors("resetting the admission budget"):
            await self._redis.hset(self._key, "in_flight", 0)
        ADMISSION_IN_FLIGHT.set(0)

    async def try_acquire(self, wanted: int, reserve: int = 0) -> int:
        """Take up to `wanted` slots, leaving `reserve` of the limit unused; return how many."""
        if wanted < 0 or reserve < 0:
            raise BudgetError("wanted and reserve must be >= 0")
        if wanted == 0:
            return 0
        with redis_errors("acquiring admission slots"):
            granted = await self._run(self._acquire, [wanted, reserve])
        if granted:
            ADMISSION_IN_FLIGHT.inc(granted)
        return granted

    async def release(self, n: int = 1) -> int:
        """Give back `n` slots; releasing more than are in flight is an error."""
        if n < 0:
            raise BudgetError("cannot release a negative number of slots")
        with redis_errors("releasing admission slots"):
            left = await self._run(self._release, [n])
        if left < 0:
            ADMISSION_IN_FLIGHT.set(0)
            raise BudgetError(f"released {n} slots, more than were in flight")
        ADMISSION_IN_FLIGHT.set(left)
        return left

    async def hold(self, limit: int, reason: str) -> None:
        """Lower the limit to `limit` until `release_hold`, saying why (`farm status`)."""
        if limit < 1:
            raise BudgetError(f"a held admission limit must be >= 1, got {limit}")
        with redis_errors("holding admission"):
            await self._redis.hset(self._key, mapping={"held_limit": limit, "held_reason": reason})
        ADMISSION_HELD.set(1)

    async def release_hold(self) -> None:
        with redis_errors("releasing the admission hold"):
            await self._redis.hdel(self._key, "held_limit", "held_reason")
        ADMISSION_HELD.set(0)

    async def held(self) -> str | None:
        """Why admission is held, or None."""
        reason = await self._redis.hget(self._key, "held_reason")
        return None if reason is None else as_str(reason)

    async def in_flight(self) -> int:
        return int(await self._redis.hget(self._key, "in_flight") or 0)

    async def limit(self) -> int:
        return int(await self._redis.hget(self._key, "limit") or 0)
