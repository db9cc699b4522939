"""Where `show` finds one trajectory group: a live stream or an archive's segments.

A group is picked by its stream entry id, by its group id, or as the latest entry.
Live streams are read newest first (XREVRANGE pages), so the latest group costs one
entry and a recent group id a page or two. Archives are read in stream order, one
entry at a time, keeping the last match (a group delivered twice shows its newest
copy); `--entry` skips every segment whose id range cannot hold it. A group id is
read off the front of the msgpack body, so the search never decodes token arrays of
entries it passes over. Entries that cannot even be peeked are counted and named in
the not-found error; the chosen entry is decoded in full and, if that fails, raises
`MalformedEntry` with the codec's reason.
"""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis.asyncio as aioredis

from broker.archive import INDEX, Archive, Entry, id_key
from broker.codec import FIELD_BODY, FIELD_KIND, decode
from broker.connection import redis_errors
from broker.errors import BrokerError, DecodeError
from broker.messages import TrajectoryGroup
from broker.replay import ReplayFilter, archive_entries

_ENTRY_ID = re.compile(r"^\d{1,20}(-\d{1,20})?$")
PAGE = 20  # entries per XREVRANGE page: group entries run to megabytes


class ShowError(BrokerError):
    """`show` could not produce a group; the message says which and why."""


class GroupNotFound(ShowError):
    """No entry matches the requested group id or entry id."""

    def __init__(self, message: str, malformed: int = 0) -> None:
        super().__init__(message)
        self.malformed = malformed  # entries that could not be searched


class MalformedEntry(ShowError):
    """The chosen entry is not a decodable trajectory group."""


@dataclass(frozen=True)
class Selector:
    """Which entry to show: at most one of the two ids; neither means the latest."""

    group_id: str | None = None  # the group's id (the task id)
    entry_id: str | None = None  # the stream entry id ("ms-seq")

    def __post_init__(self) -> None:
        if self.entry_id is not None and not _ENTRY_ID.match(self.entry_id):
            raise ShowError(
                f"entry id {self.entry_id!r} is not a stream id (MS-SEQ, as tail prints)"
            )

    def describe(self) -> str:
        if self.entry_id is not None:
            return f"entry {self.entry_id}"
        return "the latest entry" if self.group_id is None else f"group {self.group_id!r}"


@dataclass(frozen=True)
class Located:
    """A decoded group and where it was read."""

    group: TrajectoryGroup
    entry_id: str  # stream entry id
    origin: str  # the stream key, or the archive directory


def peek_group_id(fields: dict[bytes, bytes]) -> str | None:
    """The group id at the front of a group entry's body, or None (another kind, malformed)."""
    if fields.get(FIELD_KIND) != TrajectoryGroup.KIND.encode():
        return None
    try:
        unpacker = msgpack.Unpacker(io.BytesIO(fields[FIELD_BODY]), raw=False, read_size=4096)
        if unpacker.read_array_header() < 1:
            return None
        group_id = unpacker.unpack()
    except (KeyError, TypeError, ValueError, msgpack.UnpackException):
        return None
    return group_id if isinstance(group_id, str) else None


def _decode(entry: Entry, origin: str) -> Located:
    entry_id, fields = entry
    try:
        group = decode(fields, expect=TrajectoryGroup)
    except DecodeError as exc:
        raise MalformedEntry(
            f"entry {entry_id} of {origin} is not a readable group: {exc}"
        ) from exc
    assert isinstance(group, TrajectoryGroup)
    return Located(group, entry_id, origin)


def _not_found(want: Selector, origin: str, malformed: int) -> GroupNotFound:
    note = f" ({malformed} malformed entries could not be searched)" if malformed else ""
    return GroupNotFound(f"{want.describe()} not found in {origin}{note}", malformed)


async def from_streams(redis: aioredis.Redis, streams: Sequence[str], want: Selector) -> Located:
    """The selected group of a run's live streams (one per partition): the latest entry
    of them all, the group asked for, or the entry id asked for, which must be in only
    one of them (each stream numbers its own entries)."""
    found: list[Located] = []
    malformed = 0
    for stream in streams:
        try:
            found.append(await from_stream(redis, stream, want))
        except GroupNotFound as exc:
            malformed += exc.malformed
            continue
        if want.group_id is not None:
            break  # a group is published to one partition
    if not found:
        raise _not_found(want, ", ".join(streams), malformed)
    if want.entry_id is not None and len(found) > 1:
        where = ", ".join(f.origin for f in found)
        raise ShowError(f"entry {want.entry_id} is in {where}: name one with --stream")
    return max(found, key=lambda f: id_key(f.entry_id))


async def from_stream(redis: aioredis.Redis, stream: str, want: Selector) -> Located:
    """The selected group of a live stream."""
    with redis_errors(f"reading {stream}"):
        if want.entry_id is not None:
            rows = await redis.xrange(stream, min=want.entry_id, max=want.entry_id, count=1)
        elif want.group_id is None:
            rows = await redis.xrevrange(stream, count=1)
        else:
            rows = None
    if rows is not None:
        if not rows:
            raise _not_found(want, stream, 0)
        raw_id, fields = rows[0]
        return _decode((raw_id.decode(), dict(fields)), stream)
    malformed = 0
    async for entry in _newest_first(redis, stream):
        found = peek_group_id(entry[1])
        malformed += found is None
        if found == want.group_id:
            return _decode(entry, stream)
    raise _not_found(want, stream, malformed)


async def _newest_first(redis: aioredis.Redis, stream: str) -> AsyncIterator[Entry]:
    high = "+"
    while True:
        with redis_errors(f"reading {stream}"):
            rows = await redis.xrevrange(stream, max=high, min="-", count=PAGE)
        for raw_id, fields in rows:
            entry_id = raw_id.decode()
            yield entry_id, dict(fields)
            high = f"({entry_id}"
        if len(rows) < PAGE:
            return


def from_archive(directory: str | Path, want: Selector) -> Located:
    """The selected group of an archive directory (see `python -m broker archive`)."""
    path = Path(directory)
    if not (path / INDEX).is_file():
        raise ShowError(f"{path} is not an archive (no {INDEX})")
    archive = Archive(path, readonly=True)  # an archiver may be writing it right now
    origin = str(path)
    if want.entry_id is not None:
        flt = ReplayFilter(start_id=want.entry_id, end_id=want.entry_id)
        entries: Iterable[Entry] = archive_entries(archive, flt)
    elif want.group_id is None:
        entries = archive.entries(archive.segments[-1:])
    else:
        entries = archive.entries()
    chosen: Entry | None = None
    malformed = 0
    for entry in entries:
        if want.group_id is None:
            chosen = entry
            continue
        found = peek_group_id(entry[1])
        malformed += found is None
        if found == want.group_id:
            chosen = entry
    if chosen is None:
        raise _not_found(want, origin, malformed)
    return _decode(chosen, origin)
