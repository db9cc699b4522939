"""Malformed frames sent straight to a live agent (in a container / a bwrap jail): each
gets an error reply or a closed connection, and the agent keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path

from sandbox import SandboxPool
from sandbox.agent.wire import encode_frame

HEADER = struct.Struct(">I")


async def exchange(path: Path, raw: bytes, expect_reply: bool = True) -> dict | None:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(raw)
        await writer.drain()
        if not expect_reply:
            writer.write_eof()  # the frame stays cut off: the agent sees end of stream
        async with asyncio.timeout(10):
            head = await reader.read(HEADER.size)
            if len(head) < HEADER.size:
                assert not expect_reply, "agent closed without a reply"
                return None
            body = await reader.readexactly(HEADER.unpack(head)[0])
        return json.loads(body)
    finally:
        writer.close()
        await writer.wait_closed()


def agent_socket(pool: SandboxPool) -> Path:
    return pool._sandboxes[0].handle.socket_dir / "agent.sock"


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


async def test_bad_frames_get_errors_and_the_agent_survives(pool: SandboxPool) -> None:
    path = agent_socket(pool)
    cases = {
        b"{not json": "not JSON",
        b"[1, 2, 3]": "not a JSON object",
        b"\xff\xfe\x00garbage": "not JSON",
        json.dumps({"op": "explode"}).encode(): "unknown op",
        json.dumps({"op": "open", "session": "../../etc"}).encode(): "session",
        json.dumps({"op": "open", "session": 7}).encode(): "session",
    }
    for body, why in cases.items():
        reply = await exchange(path, frame(body))
        assert reply is not None and reply["ok"] is False and why in reply["error"], (body, reply)
    # several bad frames and then a good one on one connection: the stream stays usable
    batch = frame(b"nope") + frame(b"42") + encode_frame({"op": "ping"})
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(batch)
    replies = []
    for _ in range(3):
        length = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
        replies.append(json.loads(await reader.readexactly(length)))
    writer.close()
    await writer.wait_closed()
    assert [r["ok"] for r in replies] == [False, False, True]
    assert (await exchange(path, encode_frame({"op": "ping"})))["ok"]


async def test_oversized_and_truncated_frames_close_only_that_connection(
    pool: SandboxPool,
) -> None:
    path = agent_socket(pool)
    reply = await exchange(path, HEADER.pack(0xFFFFFFFF) + b"x" * 16)
    assert reply is not None and "exceeds" in reply["error"]
    assert await exchange(path, HEADER.pack(100) + b"{", expect_reply=False) is None
    # a client that connects and says nothing does not block the others
    _, idle = await asyncio.open_unix_connection(str(path))
    try:
        assert (await exchange(path, encode_frame({"op": "ping"})))["ok"]
    finally:
        idle.close()
        await idle.wait_closed()
    for _ in range(20):
        await exchange(path, frame(os.urandom(64)))
    async with pool.session() as s:
        assert (await s.run_python("print('fine')")).stdout == "fine\n"


async def test_bad_run_requests_to_a_session_socket(pool: SandboxPool) -> None:
    ceiling = pool.config.limits.ceiling(pool.config.baseline_processes)
    opened = await exchange(
        agent_socket(pool), encode_frame({"op": "open", "session": "raw1", "limits": ceiling})
    )
    assert opened is not None and opened["ok"], opened
    path = agent_socket(pool).with_name(opened["socket"])
    limits = pool.config.limits.wire(5)
    bad = [
        {"op": "run", "code": "print(1)", "timeout": 5},  # no limits
        {"op": "run", "argv": "ls", "timeout": 5, "limits": limits},
        {"op": "run", "code": 12, "timeout": 5, "limits": limits},
        {"op": "run", "code": "1", "timeout": "soon", "limits": limits},
        {"op": "run", "code": "1", "timeout": float("nan"), "limits": limits},
        {"op": "run", "code": "1", "timeout": -1, "limits": limits},
        {"op": "run", "code": "1", "timeout": 5, "limits": limits, "files": {"../x": "eA=="}},
    ]
    raw = b"".join(encode_frame(r) for r in bad) + frame(b"}{")
    raw += encode_frame(
        {"op": "run", "code": "print('still serving')", "timeout": 5, "limits": limits}
    )
    reader, writer = await asyncio.open_unix_connection(str(path))
    replies = []
    try:
        writer.write(raw)
        async with asyncio.timeout(20):
            for _ in range(len(bad) + 2):
                length = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
                replies.append(json.loads(await reader.readexactly(length)))
    finally:
        writer.close()
        await writer.wait_closed()
    assert [r["ok"] for r in replies] == [False] * (len(bad) + 1) + [True], replies
    assert replies[-1]["stdout"] == "still serving\n"
    closed = await exchange(agent_socket(pool), encode_frame({"op": "close", "session": "raw1"}))
    assert closed is not None and closed["ok"]
