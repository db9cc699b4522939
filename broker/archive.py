"""Archive: copy a stream into rolling segment files with an index.

A directory holds segment files (``seg-<first>-<last>.msgpack``, a sequence of
msgpack ``[entry_id, fields]`` records, in stream order) and ``index.json``,
which lists every segment with its first/last id, count, time span, policy
versions and environments. Writes are crash-safe: a segment is written to a
temporary file, fsynced and renamed, then the index is rewritten the same way.
A segment that a crash left out of the index is adopted on the next open, so
archiving resumes from the last archived id without gaps or repeats.

A following archiver (`follow=True`) keeps its position in Redis as the consumer group
`ARCHIVER_GROUP` on its stream, moved (XGROUP SETID) past each segment only once the
segment is on disk: `broker.trim` never trims past a group's position, so nothing is
trimmed before it is archived. `forget_archiver` removes the group when an archiver is
retired, so trimming stops waiting for it. A one-off copy registers nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.codec import decode
from broker.connection import as_str, redis_errors
from broker.errors import DecodeError
from broker.keys import ARCHIVER_GROUP
from broker.messages import Task, TrajectoryGroup

log = logging.getLogger(__name__)

INDEX = "index.json"
Entry = tuple[str, dict[bytes, bytes]]
_READ_ENTRIES = 256  # entries per XRANGE: a segment's bytes are checked between reads


@dataclass(frozen=True)
class EntryFacts:
    """What filters look at, read off one entry."""

    ms: int  # milliseconds part of the entry id
    version: int | None  # policy version (oldest weight version for a group)
    env: str | None  # environment name (spec before '@')


def entry_facts(entry_id: str, fields: dict[bytes, bytes]) -> EntryFacts:
    ms = int(entry_id.split("-", 1)[0])
    try:
        message = decode(fields)
    except DecodeError:
        return EntryFacts(ms, None, None)
    if isinstance(message, TrajectoryGroup):
        return EntryFacts(ms, message.min_weight_version, message.task.env_spec.split("@", 1)[0])
    if isinstance(message, Task):
        return EntryFacts(ms, message.policy_version, message.env_spec.split("@", 1)[0])
    return EntryFacts(ms, None, None)


@dataclass(frozen=True)
class SegmentInfo:
    """One segment file as the index describes it."""

    file: str
    first_id: str
    last_id: str
    count: int
    first_ms: int
    last_ms: int
    min_version: int | None
    max_version: int | None
    envs: tuple[str, ...]


def id_key(entry_id: str) -> tuple[int, int]:
    """Sort key for stream ids ("ms-seq")."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _describe(file: str, entries: Sequence[Entry]) -> SegmentInfo:
    facts = [entry_facts(eid, fields) for eid, fields in entries]
    versions = [f.version for f in facts if f.version is not None]
    return SegmentInfo(
        file=file,
        first_id=entries[0][0],
        last_id=entries[-1][0],
        count=len(entries),
        first_ms=facts[0].ms,
        last_ms=facts[-1].ms,
        min_version=min(versions) if versions else None,
        max_version=max(versions) if versions else None,
        envs=tuple(sorted({f.env for f in facts if f.env})),
    )


class Archive:
    """A directory of segments plus its index."""

    def __init__(self, directory: str | Path, readonly: bool = False) -> None:
        """`readonly`: read what the index lists and touch nothing, so a reader can open
        an archive that an archiver is still writing (whose .tmp files are not orphans)."""
        self.directory = Path(directory)
        if not readonly:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._segments = self._load_index()
        if not readonly:
            self._adopt_orphans()

    @property
    def segments(self) -> tuple[SegmentInfo, ...]:
        return tuple(self._segments)

    @property
    def last_id(self) -> str | None:
        return self._segments[-1].last_id if self._segments else None

    def _load_index(self) -> list[SegmentInfo]:
        path = self.directory / INDEX
        if not path.exists():
            return []
        rows = json.loads(path.read_text())["segments"]
        return [SegmentInfo(**{**r, "envs": tuple(r["envs"])}) for r in rows]

    def _write_index(self) -> None:
        body = {"version": 1, "segments": [asdict(s) for s in self._segments]}
        _fsync_write(self.directory / INDEX, json.dumps(body, indent=1).encode())

    def _adopt_orphans(self) -> None:
        known = {s.file for s in self._segments}
        for tmp in self.directory.glob("*.tmp"):
            tmp.unlink()  # an unfinished write: its entries were never recorded
        orphans = sorted(
            (p for p in self.directory.glob("seg-*.msgpack") if p.name not in known),
            key=lambda p: id_key(p.name[4:].split("_", 1)[0].replace(".", "-")),
        )
        for path in orphans:
            entries = list(self._read_file(path))
            if entries and (self.last_id is None or id_key(entries[0][0]) > id_key(self.last_id)):
                log.info("adopting segment %s left out of the index", path.name)
                self._segments.append(_describe(path.name, entries))
            else:
                path.unlink()
        if orphans:
            self._write_index()

    def append(self, entries: Sequence[Entry]) -> SegmentInfo:
        """Write one segment holding `entries` (in stream order), crash-safely."""
        if not entries:
            raise ValueError("a segment needs at least one entry")
        if self.last_id is not None and id_key(entries[0][0]) <= id_key(self.last_id):
            raise ValueError(f"entry {entries[0][0]} is not after archived {self.last_id}")
        name = f"seg-{entries[0][0].replace('-', '.')}_{entries[-1][0].replace('-', '.')}.msgpack"
        packer = msgpack.Packer(use_bin_type=True)
        data = b"".join(packer.pack([eid, fields]) for eid, fields in entries)
        _fsync_write(self.directory / name, data)
        info = _describe(name, entries)
        self._segments.append(info)
        self._write_index()
        return info

    @staticmethod
    def _read_file(path: Path) -> Iterator[Entry]:
        with open(path, "rb") as fh:
            for eid, fields in msgpack.Unpacker(fh, raw=False, strict_map_key=False):
                yield eid, dict(fields)

    def entries(self, segments: Sequence[SegmentInfo] | None = None) -> Iterator[Entry]:
        """Every archived entry, in stream order."""
        for seg in self._segments if segments is None else segments:
            yield from self._read_file(self.directory / seg.file)


async def register_archiver(redis: aioredis.Redis, stream: str, archive: Archive) -> None:
    """Put the archiver's group at the archive's last id (created if missing)."""
    last = archive.last_id or "0-0"
    with redis_errors(f"registering the archiver on {stream}"):
        try:
            await redis.xgroup_create(stream, ARCHIVER_GROUP, id=last, mkstream=True)
            return
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        for group in await redis.xinfo_groups(stream):
            held = as_str(group["last-delivered-id"])
            if as_str(group["name"]) == ARCHIVER_GROUP and id_key(held) > id_key(last):
                log.warning(
                    "the archiver's group on %s is at %s but this archive ends at %s: "
                    "entries between may have been trimmed (another archive directory?)",
                    stream,
                    held,
                    last,
                )
        await redis.xgroup_setid(stream, ARCHIVER_GROUP, last)


async def forget_archiver(redis: aioredis.Redis, stream: str) -> bool:
    """Remove the archiver's group: trimming stops waiting for it. False if there was none."""
    with redis_errors(f"removing the archiver's group from {stream}"):
        try:
            return bool(await redis.xgroup_destroy(stream, ARCHIVER_GROUP))
        except ResponseError as exc:  # no such stream
            if "no such key" in str(exc).lower():
                return False
            raise


async def archive_stream(
    redis: aioredis.Redis,
    stream: str,
    archive: Archive,
    *,
    segment_entries: int = 10_000,
    segment_bytes: int = 64 << 20,
    follow: bool = False,
    stop: asyncio.Event | None = None,
    poll_s: float = 1.0,
) -> int:
    """Copy entries after the archive's last id into segments; return how many.

    A segment is written whenever `segment_entries` entries or `segment_bytes` bytes have
    accumulated, or the stream goes quiet. With `follow`, keep going until `stop` is set,
    moving the archiver's group past each segment written (`register_archiver`): what the
    archiver holds back from trimming stays under about one segment.
    """
    if follow:
        await register_archiver(redis, stream, archive)
    cursor = archive.last_id or "0-0"
    buffer: list[Entry] = []
    total = size = 0
    while True:
        rows = await redis.xrange(stream, min=f"({cursor}", max="+", count=_READ_ENTRIES)
        for raw_id, fields in rows:
            cursor = as_str(raw_id)
            buffer.append((cursor, dict(fields)))
            size += sum(len(v) for v in fields.values())
            if len(buffer) >= segment_entries or size >= segment_bytes:
                total += await _write_segment(redis, stream, archive, buffer, follow)
                buffer, size = [], 0
        if rows:
            continue
        if buffer:  # the stream went quiet
            total += await _write_segment(redis, stream, archive, buffer, follow)
            buffer, size = [], 0
        if not follow or (stop is not None and stop.is_set()):
            return total
        if stop is not None:
            try:
                await asyncio.wait_for(stop.wait(), timeout=poll_s)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(poll_s)


async def _write_segment(
    redis: aioredis.Redis, stream: str, archive: Archive, entries: list[Entry], follow: bool
) -> int:
    """Write `entries` as a segment; a following archiver's group then moves past them."""
    archive.append(entries)
    if follow:  # on disk now: trimming may pass it
        with redis_errors(f"moving the archiver's group on {stream}"):
            await redis.xgroup_setid(stream, ARCHIVER_GROUP, entries[-1][0])
    return len(entries)
