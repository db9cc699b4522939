"""The frames of the agent protocol: a 4-byte big-endian length and a UTF-8 JSON object.

Never pickle. A bad frame raises `FrameError`; ``fatal`` means the stream cannot be
re-synchronised and the connection must close. The host side (`sandbox.client`)
imports these same definitions.
"""

from __future__ import annotations

import json
import socket
import struct

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024


class FrameError(Exception):
    """A frame could not be decoded; ``fatal`` means the stream cannot continue."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def encode_frame(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise FrameError("connection closed mid-frame", fatal=True)
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> dict | None:
    """Blocking read of one frame; None on a clean end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (length,) = HEADER.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}", fatal=True)
    body = _recv_exact(sock, length)
    if body is None:
        raise FrameError("connection closed mid-frame", fatal=True)
    return decode_body(body)


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(encode_frame(obj))


def _error(message: str) -> dict:
    return {"ok": False, "error": message}
