"""Consuming streams through a consumer group, at least once, without losses.

Invariants:
- an entry is acked only by `commit`, after the caller's effect is done; the
  commit (optional publish, XACK, mark-seen) is one Lua script shielded from
  cancellation, so it happens entirely or not at all; a commit of a batch is one
  script call, so the whole batch is acked (and its ids recorded) or none of it;
- after a restart under the same consumer name, `read` first returns that
  consumer's own pending entries;
- entries idle on another consumer for `reclaim_idle_s` are claimed (XAUTOCLAIM);
- an entry that cannot be decoded, has an unknown schema version, or was
  delivered more than `max_deliveries` times goes to the dead-letter stream with
  its reason, and is acked there in the same transaction; `read` never raises
  for a bad entry, and a bad entry never holds back the good ones of its batch;
- an entry whose message id a commit already recorded is acked and dropped, and
  so is a second entry with the same message id within one read (acked without
  recording the id, so the first one's effect is still owed and its entry pending);
- `read` settles everything it will not hand over (dead letters, duplicates,
  entries trimmed while pending) in one commit per read (one per hash tag);
- every command and script touches one hash tag (`broker.keys`): streams of several
  partitions are read with one XREADGROUP per partition, never more than `count`
  entries in all, and a commit spanning partitions runs one script per partition;
- with `wait_replicas` > 0 a commit counts as done only once WAIT reports that many
  replicas have it (else `RedisUnavailable`, and the caller retries: commits are idempotent).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pydantic
import redis.asyncio as aioredis
from prometheus_client import Counter
from pydantic import Field
from redis.exceptions import ResponseError

from broker.codec import decode, encode
from broker.commit import COMMIT_SCRIPT, Ack, commit_args
from broker.connection import as_str, redis_errors
from broker.errors import DecodeError
from broker.keys import RunKeys, hash_tag
from broker.messages import DeadLetter, Message, Task, TrajectoryGroup
from broker.metrics import ACKED, CONSUMED, DEADLETTERED, DUPLICATES, PUBLISHED, RECLAIMED
from broker.replication import check_wait, queue_wait
from broker.slots import SlotReader

log = logging.getLogger(__name__)


@pydantic.dataclasses.dataclass(frozen=True, config=pydantic.ConfigDict(extra="forbid"))
class ConsumerSettings:
    """Reclaim and dead letters: the consumer-group settings a role exposes."""

    reclaim_idle_s: float = Field(
        60.0, gt=0.0, description="idle seconds before a dead consumer's entries are taken over"
    )
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry is dead-lettered")
    wait_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="replicas that must hold a commit (Redis WAIT) before it counts as acked; "
        "0: do not wait (an acked commit can be lost if its master fails before replicating)",
    )
    wait_timeout_ms: int = Field(
        1000, ge=1, le=60_000, description="how long a commit waits for its replicas (WAIT timeout)"
    )
    seen_ttl_s: float = Field(
        86_400.0,
        ge=60.0,
        description="how long committed message ids are remembered for dedup (a task run "
        "twice, a replay of the run's own entries); ~120 bytes of Redis each",
    )


@dataclass(frozen=True)
class ConsumerConfig:
    """How a consumer reads, reclaims and gives up."""

    group: str
    consumer: str
    # reclaim, dead letters and WAIT: the role's settings, as the role resolved them
    settings: ConsumerSettings = field(default_factory=ConsumerSettings)
    block_ms: int = 1000  # longest blocking read; kept under the socket timeout
    count: int = 16  # entries per read
    reclaim_interval_s: float = 5.0  # how often read() looks for idle entries


@dataclass(frozen=True)
class Delivery:
    """One decoded entry handed to the caller."""

    stream: str
    entry_id: str
    message: Message
    deliveries: int  # times this entry has been delivered, this one included


def message_id(message: Message) -> str:
    """The id consumers dedup on."""
    if isinstance(message, Task):
        return message.task_id
    if isinstance(message, TrajectoryGroup):
        return message.group_id
    return ""


class Consumer:
    """Reads one or more streams through a consumer group."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RunKeys,
        streams: Sequence[str],
        config: ConsumerConfig,
        expect: type | None = None,
    ) -> None:
        if not streams:
            raise ValueError("a consumer needs at least one stream")
        self._redis = redis
        self._keys = keys
        self._streams = list(streams)
        self._config = config
        self._expect = expect
        self._reader = SlotReader(redis, config.group, config.consumer, self._streams)
        self._last_reclaim = 0.0
        self._commit = redis.register_script(COMMIT_SCRIPT)

    @property
    def config(self) -> ConsumerConfig:
        return self._config

    async def ensure_groups(self, start: str = "0") -> None:
        """Create the group on every stream if it does not exist: reading from the start
        ("0"), or only what is added after now ("$"); an existing group keeps its place."""
        for stream in self._streams:
            with redis_errors(f"creating group {self._config.group} on {stream}"):
                try:
                    await self._redis.xgroup_create(
                        stream, self._config.group, id=start, mkstream=True
                    )
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def destroy_group(self) -> None:
        """Remove the group from every stream, with its seen sets: for a one-off reader
        (an evaluation) whose group nothing reads again."""
        with redis_errors(f"removing group {self._config.group}"):
            for stream in self._streams:
                await self._redis.xgroup_destroy(stream, self._config.group)
            for partition in sorted({self._keys.partition_of(s) for s in self._streams}):
                await self._redis.delete(self._keys.seen(self._config.group, partition))

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[Delivery]:
        """Return up to `count` good deliveries; bad entries are dead-lettered on the way."""
        count = count or self._config.count
        block = self._config.block_ms if block_ms is None else block_ms
        with redis_errors(f"read from {self._streams}"):
            raw = await self._reader.pending(count)
            if raw:
                return await self._accept(raw, pending=True)
            now = time.monotonic()
            if now - self._last_reclaim >= self._config.reclaim_interval_s:
                self._last_reclaim = now
                claimed = await self._reclaim(count)
                if claimed:
                    return claimed
            raw = await self._reader.new(count, block)
            return await self._accept(raw, pending=False)

    async def _reclaim(self, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        left = count  # in all streams together, like a read
        for stream in self._streams:
            if left <= 0:
                break
            reply = await self._redis.xautoclaim(
                stream,
                self._config.group,
                self._config.consumer,
                min_idle_time=int(self._config.settings.reclaim_idle_s * 1000),
                start_id="0-0",
                count=left,
            )
            entries = [(eid, fields) for eid, fields in reply[1] if fields is not None]
            left -= len(entries)
            if entries:
                RECLAIMED.labels(stream=stream, group=self._config.group).inc(len(entries))
                log.info("reclaimed %d idle entries from %s", len(entries), stream)
                out.extend(await self._accept([(stream, entries)], pending=True))
        return out

    async def _delivery_counts(self, stream: str, ids: list[str]) -> dict[str, int]:
        rows = await self._redis.xpending_range(
            stream,
            self._config.group,
            min=ids[0],
            max=ids[-1],
            count=len(ids) + 64,
            consumername=self._config.consumer,
        )
        return {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}

    async def _accept(
        self, raw: list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]], pending: bool
    ) -> list[Delivery]:
        """Decode a read's entries; settle the bad, trimmed and duplicate ones in one commit."""
        candidates: list[Delivery] = []
        acks: list[Ack] = []  # entries to ack without handing them over
        letters: list[tuple[str, DeadLetter]] = []
        for stream, entries in raw:
            if not entries:
                continue
            CONSUMED.labels(stream=stream, group=self._config.group).inc(len(entries))
            ids = [as_str(eid) for eid, _ in entries]
            counts = await self._delivery_counts(stream, ids) if pending else {}
            for entry_id, (_, fields) in zip(ids, entries, strict=True):
                deliveries = counts.get(entry_id, 1)
                if not fields:  # trimmed away while pending: nothing left to process
                    acks.append((stream, entry_id, ""))
                    continue
                limit = self._config.settings.max_deliveries
                if deliveries > limit:
                    reason = f"delivered {deliveries} times (max {limit})"
                else:
                    try:
                        message = decode(fields, expect=self._expect)
                    except DecodeError as exc:
                        reason = str(exc)
                    else:
                        candidates.append(Delivery(stream, entry_id, message, deliveries))
                        continue
                acks.append((stream, entry_id, ""))
                letters.append((stream, self._letter(stream, entry_id, fields, reason, deliveries)))
        fresh = await self._drop_duplicates(candidates, acks)
        if acks:
            moved = [(self._deadletter_key(stream), letter) for stream, letter in letters]
            await self._shielded(acks, moved)
            _count(DEADLETTERED, [stream for stream, _ in letters])
        return fresh

    async def _drop_duplicates(self, candidates: list[Delivery], acks: list[Ack]) -> list[Delivery]:
        """The candidates to hand over; the rest are appended to `acks`: those whose id a
        commit recorded, and repeats of an id earlier in the same read (acked without
        recording the id: the first one's effect is still owed)."""
        mids = [message_id(d.message) for d in candidates]
        if not any(mids):
            return candidates
        scores = await self._seen_scores(candidates, mids)
        fresh: list[Delivery] = []
        dupes: list[str] = []
        taken: set[str] = set()
        for delivery, mid, score in zip(candidates, mids, scores, strict=True):
            if mid and (score is not None or mid in taken):
                acks.append((delivery.stream, delivery.entry_id, mid if score is not None else ""))
                dupes.append(delivery.stream)
                continue
            taken.add(mid)
            fresh.append(delivery)
        if dupes:
            _count(DUPLICATES, dupes, group=self._config.group)
            _count(ACKED, dupes, group=self._config.group)
            log.info("dropping %d duplicate entries", len(dupes))
        return fresh

    def _letter(
        self, stream: str, entry_id: str, fields: dict[bytes, bytes], reason: str, deliveries: int
    ) -> DeadLetter:
        log.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
        consumer = self._config.consumer
        return DeadLetter(stream, entry_id, reason, dict(fields), deliveries, consumer)

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move a decoded entry the caller cannot use to the dead-letter stream, with the
        reason, and ack it, in one commit (its message id is recorded: never redone)."""
        await self.commit([], dead_letters=[(delivery, reason)])

    async def keep_alive(self, stream: str, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that
        `reclaim_idle_s` only ever takes over work whose consumer has died."""
        if not entry_ids:
            return
        with redis_errors(f"keep-alive on {stream}"):
            await self._redis.xclaim(
                stream, self._config.group, self._config.consumer, 0, list(entry_ids), justid=True
            )

    async def commit(
        self,
        deliveries: Sequence[Delivery],
        publish: Sequence[tuple[str, Message]] = (),
        dead_letters: Sequence[tuple[Delivery, str]] = (),
    ) -> list[str]:
        """Atomically publish `publish` (skipping message ids already committed), ack
        `deliveries` and record their message ids, and move each `(delivery, reason)` of
        `dead_letters` to the dead-letter stream (acked, its id recorded: never redone), all
        in one script call. Returns the entry ids of `publish`, "" for each skipped one.
        Runs to completion even if the caller is cancelled."""
        acks: list[Ack] = [(d.stream, d.entry_id, message_id(d.message)) for d in deliveries]
        letters: list[tuple[str, Message]] = []
        for d, reason in dead_letters:
            acks.append((d.stream, d.entry_id, message_id(d.message)))
            letter = self._letter(d.stream, d.entry_id, encode(d.message), reason, d.deliveries)
            letters.append((self._deadletter_key(d.stream), letter))
        published = await self._shielded(acks, [*publish, *letters])
        _count(ACKED, [stream for stream, _, _ in acks], group=self._config.group)
        _count(DEADLETTERED, [d.stream for d, _ in dead_letters])
        return published[: len(publish)]

    async def _shielded(
        self, acks: Sequence[Ack], publish: Sequence[tuple[str, Message]]
    ) -> list[str]:
        """Run the commit (one script per hash tag) to completion even if the caller is
        cancelled."""
        task = asyncio.ensure_future(self._run_commits(acks, publish))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=self._config.block_ms / 1000 + 5)
            raise

    async def _run_commit(
        self, acks: Sequence[Ack], publish: Sequence[tuple[str, Message]]
    ) -> list[str]:
        cfg = self._config
        streams, args = commit_args(
            cfg.group,
            cfg.settings.seen_ttl_s,
            acks,
            [(stream, message_id(m), encode(m)) for stream, m in publish],
        )
        keys = [self._seen_key(streams[0]), *streams]
        with redis_errors("commit"):
            result = await self._eval_commit(keys, args)
        published = [as_str(r) for r in result]
        _count(
            PUBLISHED, [stream for (stream, _), eid in zip(publish, published, strict=True) if eid]
        )
        return published

    def _seen_key(self, stream: str) -> str:
        """This group's seen set in the partition (hash tag) of `stream`."""
        return self._keys.seen(self._config.group, self._keys.partition_of(stream))

    def _deadletter_key(self, stream: str) -> str:
        """The dead-letter stream in the partition (hash tag) of `stream`."""
        return self._keys.deadletter_of(self._keys.partition_of(stream))

    async def _seen_scores(self, candidates: list[Delivery], mids: list[str]) -> list[object]:
        """ZMSCORE of each message id in its own partition's seen set (one call per set)."""
        by_key: dict[str, list[int]] = {}
        for i, d in enumerate(candidates):
            by_key.setdefault(self._seen_key(d.stream), []).append(i)
        scores: list[object] = [None] * len(candidates)
        for key, index in by_key.items():
            got = await self._redis.zmscore(key, [mids[i] for i in index])
            for i, score in zip(index, got, strict=True):
                scores[i] = score
        return scores

    async def _run_commits(
        self, acks: Sequence[Ack], publish: Sequence[tuple[str, Message]]
    ) -> list[str]:
        """One commit script per hash tag (a script may not span cluster slots);
        the published ids come back in `publish` order."""
        streams = [a[0] for a in acks] + [s for s, _ in publish]
        tags = list(dict.fromkeys(hash_tag(s) for s in streams))
        if len(tags) <= 1:
            return await self._run_commit(acks, publish) if tags else []
        published: dict[int, str] = {}
        for tag in tags:
            mine = [i for i, (s, _) in enumerate(publish) if hash_tag(s) == tag]
            ids = await self._run_commit(
                [a for a in acks if hash_tag(a[0]) == tag], [publish[i] for i in mine]
            )
            published.update(zip(mine, ids, strict=True))
        return [published[i] for i in range(len(publish))]

    async def _eval_commit(self, keys: list[str], args: list[object]) -> list[bytes | str]:
        """Run the commit script; with `wait_replicas`, WAIT on the same connection."""
        cfg = self._config.settings
        if not cfg.wait_replicas:
            return await self._commit(keys=keys, args=args)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.eval(COMMIT_SCRIPT, len(keys), *keys, *args)  # type: ignore[arg-type]
            queue_wait(pipe, self._redis, keys[0], cfg.wait_replicas, cfg.wait_timeout_ms)
            result, reached = await pipe.execute()
        check_wait(reached, cfg.wait_replicas, cfg.wait_timeout_ms, "commit")
        return result


def _count(metric: Counter, streams: Sequence[str], **labels: str) -> None:
    """Bump `metric` once per stream (a label lookup per stream, not per entry)."""
    for stream, n in collections.Counter(streams).items():
        metric.labels(stream=stream, **labels).inc(n)
