"""The host side of the agent protocol: one asyncio connection to one agent socket.

Frames are those of `sandbox.agent.wire` (4-byte length, JSON object), imported from there
so both sides share one definition. Every await is bounded by a timeout; any failure
of the exchange closes the connection, because a half-read frame cannot be resumed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from sandbox.agent.wire import HEADER, MAX_FRAME, encode_frame
from sandbox.errors import AgentProtocolError


class AgentConnection:
    """A connection to an agent or session socket; requests are serialised."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()
        self.closed = False

    @classmethod
    async def open(cls, path: Path, limit_s: float) -> AgentConnection:
        """Connect; OSError / TimeoutError propagate for the caller to translate."""
        async with asyncio.timeout(limit_s):
            reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_FRAME)
        return cls(reader, writer)

    async def request(self, obj: dict[str, Any], limit_s: float) -> dict[str, Any]:
        """Send one request and return the reply object.

        Raises ConnectionError when the peer went away (EOF, reset), TimeoutError when it
        did not answer in time, and AgentProtocolError for an unreadable reply.
        """
        async with self._lock:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                async with asyncio.timeout(limit_s):
                    self._writer.write(encode_frame(obj))
                    await self._writer.drain()
                    head = await self._reader.readexactly(HEADER.size)
                    (length,) = HEADER.unpack(head)
                    if length > MAX_FRAME:
                        raise AgentProtocolError(f"reply frame of {length} bytes")
                    body = await self._reader.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                await self.close()
                raise ConnectionError("agent closed the connection") from exc
            except BaseException:
                await self.close()
                raise
        try:
            reply = json.loads(body)
        except ValueError as exc:
            await self.close()
            raise AgentProtocolError(f"reply is not JSON: {exc}") from exc
        if not isinstance(reply, dict):
            raise AgentProtocolError("reply is not a JSON object")
        return reply

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            pass  # the peer is gone already; nothing left to flush


def check(reply: dict[str, Any], what: str) -> dict[str, Any]:
    """Raise AgentProtocolError unless the agent said ok."""
    if not reply.get("ok"):
        raise AgentProtocolError(f"{what}: {reply.get('error', reply)}")
    return reply
