"""Reading a consumer group's streams one cluster slot at a time.

One XREADGROUP may not name keys of several Redis Cluster slots (CROSSSLOT), so
`SlotReader` groups a consumer's streams by hash tag (`broker.keys`: one tag per
partition) and reads each group with its own command. COUNT bounds every stream of
a command, so a read over several slots asks each slot for what is still missing:
never more than `count` entries in all. It also owns the cursor through the
consumer's own pending entries, which a restarted consumer reads first.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.connection import Client, as_str
from broker.keys import hash_tag

# XREADGROUP's reply, per stream: (stream, [(entry id, fields), ...]).
Raw = list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]


class SlotReader:
    """XREADGROUP over streams of several hash tags, one command per tag."""

    def __init__(self, redis: Client, group: str, consumer: str, streams: Sequence[str]) -> None:
        self._redis = redis
        self._group = group
        self._consumer = consumer
        by_tag: dict[str, list[str]] = {}
        for stream in streams:
            by_tag.setdefault(hash_tag(stream), []).append(stream)
        self._slots = list(by_tag.values())
        self._turn = 0  # which slot the next read starts with (fairness)
        # Cursor through this consumer's own pending entries (read once after a restart).
        self._pending_cursor: dict[str, str] = {stream: "0" for stream in streams}

    async def pending(self, count: int) -> Raw:
        """This consumer's next pending entries (one slot's), or [] once all were read."""
        while self._pending_cursor:
            slot = self._first_pending_slot()
            raw = await self._xreadgroup(slot, count, None)
            got = {stream: entries for stream, entries in raw if entries}
            for stream in slot:
                if stream in got:
                    self._pending_cursor[stream] = as_str(got[stream][-1][0])
                else:
                    del self._pending_cursor[stream]
            if got:
                return raw
        return []

    def _first_pending_slot(self) -> dict[str, str]:
        for group in self._slots:
            ids = {s: self._pending_cursor[s] for s in group if s in self._pending_cursor}
            if ids:
                return ids
        raise AssertionError("no pending cursor left")

    async def new(self, count: int, block: int | None) -> Raw:
        """Up to `count` new entries in all.

        A sweep without blocking first, starting at a rotating slot; when it finds
        nothing, a blocking read on one slot, in turn, for a share of `block`
        (at least 100 ms), so a read never waits much longer than `block`.
        """
        if len(self._slots) == 1:
            return await self._xreadgroup({s: ">" for s in self._slots[0]}, count, block)
        start = self._turn % len(self._slots)
        self._turn += 1
        order = self._slots[start:] + self._slots[:start]
        out: Raw = []
        left = count
        for slot in order:
            if left <= 0:
                break
            got = await self._xreadgroup({s: ">" for s in slot}, left, None)
            out += got
            left -= sum(len(entries) for _, entries in got)
        if left < count or block is None:
            return out
        share = max(block // len(order), min(block, 100))
        return await self._xreadgroup({s: ">" for s in order[0]}, count, share)

    async def _xreadgroup(self, ids: dict[str, str], count: int, block: int | None) -> Raw:
        reply = await self._redis.xreadgroup(
            self._group, self._consumer, ids, count=count, block=block
        )
        return [(as_str(stream), entries) for stream, entries in (reply or [])]
