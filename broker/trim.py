"""Stream bounds: Redis holds what is in flight, not history.

Invariants:
- an entry of a work stream (tasks, trajectories, eval results) that some consumer group
  has not acknowledged, pending or not yet delivered, is never trimmed: a group's floor is
  its oldest pending entry, else the entry after its last delivery, and the stream is
  trimmed (`XTRIM MINID`) to the lowest floor of its groups. The archiver is one of those
  groups (`ARCHIVER_GROUP`, moved only past what a segment file holds), so where it runs,
  nothing is trimmed before it is written, and where it does not, nothing waits for it;
- a work stream is trimmed only once the groups that must read it exist (the workers' on
  a tasks stream, the learner's on a trajectories stream): before that, nothing is acked;
- what is left is bounded by bytes (`MEMORY USAGE ... SAMPLES 0`) and entries; above
  either bound the stream is reported over, and `StreamKeeper` holds admission at one
  batch (`AdmissionBudget.hold`) until it is back under: the run slows down, it loses
  nothing. It says so once on entering and once on leaving;
- record streams (dead letters, policy events) have no acknowledgement: they are kept to
  the same bounds by dropping their oldest entries, counted and logged.

Every command touches one key, so all of it works on a Redis Cluster as on one node.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.admission import AdmissionBudget
from broker.archive import id_key
from broker.bounds import StreamBounds
from broker.connection import as_str, redis_errors
from broker.errors import BrokerError
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.metrics import STREAM_BYTES, STREAM_OVER, TRIMMED

log = logging.getLogger(__name__)
_FITS = 4  # proportional cuts of a record stream before giving up until the next pass


@dataclass(frozen=True)
class StreamUsage:
    """One stream after a trim."""

    stream: str
    entries: int
    bytes: int
    trimmed: int  # entries this pass removed
    holder: str | None = None  # the group whose floor kept the oldest entry (work streams)
    over: str | None = None  # why the stream is above its bounds, else None


def _after(entry_id: str) -> str:
    """The smallest id after `entry_id` (what MINID must be to drop it and keep the rest)."""
    ms, seq = id_key(entry_id)
    return f"{ms}-{seq + 1}"


async def _floor(redis: aioredis.Redis, stream: str, group: dict) -> str:
    """The oldest id `group` still needs on `stream`, from its XINFO GROUPS row `group`."""
    name = as_str(group["name"])
    if int(group["pending"]):
        oldest = (await redis.xpending(stream, name))["min"]
        # The row is older than the XPENDING reply: what it counted as pending may be acked
        # by now (no min). Then the group needs what follows its delivered entries, and the
        # row's last-delivered-id is at or before today's, so that floor keeps too much at
        # worst, never too little.
        if oldest is not None:
            return as_str(oldest)
    return _after(as_str(group["last-delivered-id"]))


async def _groups(redis: aioredis.Redis, stream: str) -> list[dict]:
    try:
        return list(await redis.xinfo_groups(stream))
    except ResponseError as exc:  # no such key: nothing to trim
        if "no such key" in str(exc).lower():
            return []
        raise


class StreamTrimmer:
    """Trims a run's streams to what is needed and measures what is left."""

    def __init__(self, redis: aioredis.Redis, keys: RunKeys, bounds: StreamBounds) -> None:
        self.redis = redis
        self.keys = keys
        self.bounds = bounds
        self.required = {s: WORKERS_GROUP for s in keys.all_tasks}
        self.required.update({s: LEARNER_GROUP for s in keys.all_trajectories})
        self.work = (*keys.all_tasks, *keys.all_trajectories, *keys.all_evals)
        self.records = (*keys.all_deadletters, keys.policy_events)

    async def trim(self) -> list[StreamUsage]:
        """One pass over every stream of the run."""
        with redis_errors("trimming the streams"):
            out = [await self._trim_work(s) for s in self.work]
            out += [await self._trim_record(s) for s in self.records]
        for usage in out:
            STREAM_BYTES.labels(stream=usage.stream).set(usage.bytes)
            STREAM_OVER.labels(stream=usage.stream).set(usage.over is not None)
            if usage.trimmed:
                TRIMMED.labels(stream=usage.stream).inc(usage.trimmed)
        return out

    async def _size(self, stream: str) -> tuple[int, int]:
        entries = int(await self.redis.xlen(stream))
        if not entries:
            return 0, 0
        return entries, int(await self.redis.memory_usage(stream, samples=0) or 0)

    async def _trim_work(self, stream: str) -> StreamUsage:
        groups = await _groups(self.redis, stream)
        names = {as_str(g["name"]) for g in groups}
        trimmed, holder = 0, None
        needed = self.required.get(stream)
        if groups and (needed is None or needed in names):
            floors = [(await _floor(self.redis, stream, g), as_str(g["name"])) for g in groups]
            floor, holder = min(floors, key=lambda f: id_key(f[0]))
            trimmed = int(await self.redis.xtrim(stream, minid=floor, approximate=False))
        elif not groups and needed is None:  # eval results nobody reads any more
            trimmed = int(await self.redis.xtrim(stream, maxlen=0, approximate=False))
        entries, size = await self._size(stream)
        over = self._over(entries, size)
        return StreamUsage(stream, entries, size, trimmed, holder, over)

    def _over(self, entries: int, size: int) -> str | None:
        bounds = self.bounds
        if size > bounds.max_bytes:
            return f"{size} bytes of unacknowledged entries, over --stream-max-bytes {bounds.max_bytes}"
        if entries > bounds.maxlen:
            return f"{entries} unacknowledged entries, over --stream-maxlen {bounds.maxlen}"
        return None

    async def _trim_record(self, stream: str) -> StreamUsage:
        entries, size = await self._size(stream)
        trimmed = 0
        for _ in range(_FITS):  # the oldest go first, in proportion to the bytes over
            keep = min(entries, self.bounds.maxlen)
            if size > self.bounds.max_bytes:
                keep = min(keep, int(entries * self.bounds.max_bytes / size * 0.95))
            if keep >= entries:
                break
            trimmed += int(await self.redis.xtrim(stream, maxlen=keep, approximate=False))
            entries, size = await self._size(stream)
        if trimmed:
            log.warning(
                "dropped the %d oldest entries of %s to keep it within its bounds "
                "(--stream-maxlen %d, --stream-max-bytes %d)",
                trimmed,
                stream,
                self.bounds.maxlen,
                self.bounds.max_bytes,
            )
        return StreamUsage(stream, entries, size, trimmed)


class StreamKeeper:
    """Runs the trimmer every `trim_interval_s` and holds admission while a stream is over."""

    def __init__(self, trimmer: StreamTrimmer, budget: AdmissionBudget, hold_limit: int) -> None:
        self.trimmer = trimmer
        self.budget = budget
        self.hold_limit = hold_limit  # admission while held: one batch, so the run goes on
        self.held: str | None = None  # the reason admission is held, else None
        self.started = False  # a hold an earlier process left in Redis is released at once

    async def keep(self) -> list[StreamUsage]:
        """One trim, then hold or release admission; returns the usage of every stream."""
        usage = await self.trimmer.trim()
        over = [u for u in usage if u.over is not None]
        if over and self.held is None:
            worst = max(over, key=lambda u: u.bytes)
            reason = f"stream {worst.stream} holds {worst.over}"
            if worst.holder is not None:
                reason += f"; the oldest is held by group {worst.holder!r}"
            await self.budget.hold(self.hold_limit, reason)
            self.held = reason
            log.warning(
                "admission backs off to %d tasks in flight: %s. Unacknowledged entries are "
                "never trimmed; raise --stream-max-bytes/--stream-maxlen (docs/deploy.md, "
                '"Redis sizing"), or see why that group is behind (`farm status`)',
                self.hold_limit,
                reason,
            )
        elif not over and (self.held is not None or not self.started):
            await self.budget.release_hold()
            if self.held is not None:
                log.info("admission back to its limit: every stream is within its bounds")
            self.held = None
        self.started = True
        return usage

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the streams until `stop`; a Redis outage skips a round, never ends the loop."""
        while not stop.is_set():
            try:
                await self.keep()
            except BrokerError as exc:
                log.warning("streams not trimmed this round: %s", exc)
            except Exception:  # a fault of this module: said loudly, and the next round tries
                # Ending the loop would leave Redis to grow unbounded, unseen: a keeper that
                # died this way in a one-hour soak trimmed nothing after its first 10 s.
                log.exception("streams not trimmed this round")
            try:
                await asyncio.wait_for(stop.wait(), self.trimmer.bounds.trim_interval_s)
            except TimeoutError:
                pass
