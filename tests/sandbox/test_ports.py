"""Ports are private to a session: each has its own loopback (a network namespace of its
own), on both backends. Two ``terminal`` episodes in one container serve on the same
fixed port and each check reaches its own server only."""

from __future__ import annotations

import json
from typing import Any

import envs
from sandbox import SandboxPool

SERVE = "python3 -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 & echo serving"
# holds the port its neighbour wants next, for as long as the test runs
SQUAT = """
import socket, time
s = socket.socket()
s.bind(('127.0.0.1', 8001))
s.listen()
print('holding 8001', flush=True)
time.sleep(60)
"""
# the neighbour's server, if this loopback has one (a server listens a little late)
FETCH = """
import time, urllib.request
for _ in range(15):
    try:
        print(urllib.request.urlopen('http://127.0.0.1:{port}/secret.txt', timeout=2).read().decode())
        break
    except OSError as exc:
        why = type(exc).__name__
        time.sleep(0.2)
else:
    print('refused', why)
"""


async def test_each_session_has_its_own_loopback(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2, max_sandboxes=2)
    async with pool.session() as victim, pool.session() as attacker:
        await victim.write_file("secret.txt", "victim-secret")
        assert (await victim.shell(SERVE.format(port=8000))).ok
        mine = await victim.run_python(FETCH.format(port=8000))
        assert mine.stdout == "victim-secret\n", mine  # its server is up
        theirs = await attacker.run_python(FETCH.format(port=8000))
        assert theirs.stdout.startswith("refused"), theirs
        await attacker.write_file("squat.py", SQUAT)
        squat = await attacker.shell("python3 squat.py & sleep 1")
        assert "holding 8001" in squat.stdout, squat
        again = await victim.shell(SERVE.format(port=8001))  # its own 8001 is free
        assert again.ok, again
        took = await victim.run_python(FETCH.format(port=8001))
    assert took.stdout == "victim-secret\n", took


SOLVE = ("shell", {"command": "python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 &"})


def call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def test_two_terminal_episodes_side_by_side_in_one_container(pool_factory) -> None:
    """Each episode's check reads its own 127.0.0.1:8000: the one that served scores 1,
    the one that did nothing scores 0 although its neighbour serves on that port."""
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2, max_sandboxes=2)
    solver, idler = (envs.make('terminal@{"tasks": ["serve-file"]}', sandbox=pool) for _ in "ab")
    try:
        await envs.areset(solver, seed=0)
        await envs.areset(idler, seed=0)
        if pool.config.backend == "docker":  # one container holds both episodes
            assert solver._session.sandbox is idler._session.sandbox
        obs, _, done, _, info = await envs.astep(solver, call(*SOLVE))
        assert not done and "error" not in info, obs
        _, solved, done, _, _ = await envs.astep(solver, call("submit", {}))
        assert done and solved == 1.0
        await envs.areset(solver, seed=0)  # serving again, and left running this time
        await envs.astep(solver, call(*SOLVE))
        _, idle, done, _, _ = await envs.astep(idler, call("submit", {}))
        assert done and idle == 0.0  # its neighbour's server is not on its loopback
    finally:
        await envs.aclose(solver)
        await envs.aclose(idler)
