"""A session's bridge: its program reaches the host's socket, and no neighbour can.

The host serves a small aiohttp app on the bridge socket, as the worker's agent endpoint
does. The victim's program (under `Session.run_bridged`) calls it over its own loopback
and then holds its call open while an attacker session of the same pool (on Docker, of
the same container) tries every way to the bridge it could know of: the victim's port,
the socket's path, the relay's descriptor. Each must fail, and the host must see only
the victim's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from sandbox import SandboxPool

VICTIM = """
import os, urllib.request
base = os.environ['OPENAI_BASE_URL']
port = base.rsplit(':', 1)[1].split('/')[0]
def get(path):
    req = urllib.request.Request(base + path,
                                 headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})
    return urllib.request.urlopen(req, timeout=120).read().decode()
print(get('/hello/%s/%d' % (port, os.getppid())))
print(get('/wait'))
"""

# each probe prints name -> "denied: <error>" or "DONE"; any DONE is a breach
ATTACK = """
import json, os, socket
v = json.loads({victim!r})
out = {{}}
def probe(name, fn):
    try:
        fn()
        out[name] = 'DONE'
    except OSError as exc:
        out[name] = 'denied: ' + type(exc).__name__
def unix(path):
    def f():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(path)
    return f
def port():
    socket.create_connection(('127.0.0.1', v['port']), timeout=5)
probe('port', port)
probe('path', unix('/run/agent/' + v['bridge']))
probe('relay_fd', unix('/proc/%d/fd/5' % v['relay']))
probe('own_fd', unix('/proc/self/fd/5'))
probe('list', lambda: os.listdir('/run/agent'))
print(json.dumps(out))
"""


class Host:
    """The host's side of the bridge: records every request; `/wait` answers on `release`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.hello: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization", "")))
        parts = request.path.split("/")
        if parts[2] == "hello":
            await self.hello.put((int(parts[3]), int(parts[4])))
            return web.Response(text="hello from the host")
        await self.release.wait()
        return web.Response(text="released")

    @contextlib.asynccontextmanager
    async def serve(self, path: Path) -> AsyncIterator[None]:
        app = web.Application()
        app.router.add_get("/v1/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        try:
            yield
        finally:
            await runner.cleanup()


async def test_only_the_bridged_session_reaches_its_bridge(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=4)
    host = Host()
    async with pool.session(bridge=host.serve) as victim, pool.session() as attacker:
        assert (victim.sandbox is attacker.sandbox) == (pool.config.backend == "docker")
        assert victim.bridge is not None and attacker.bridge is None
        call = asyncio.ensure_future(
            victim.run_bridged(
                ["python3", "-c", VICTIM], env={"OPENAI_API_KEY": "ep-victim"}, timeout=120
            )
        )
        port, relay = await asyncio.wait_for(host.hello.get(), 60)
        known = {"port": port, "relay": relay, "bridge": victim.bridge}
        r = await attacker.run_python(ATTACK.format(victim=json.dumps(known)))
        host.release.set()
        done = await call
    assert r.ok, r
    probes = json.loads(r.stdout)
    assert all(v.startswith("denied") for v in probes.values()), probes
    assert done.ok, done
    assert done.stdout.split() == ["hello", "from", "the", "host", "released"]
    assert [auth for _, auth in host.seen] == ["Bearer ep-victim"] * 2, host.seen
    assert not (victim.sandbox.handle.socket_dir / victim.bridge).exists()


async def test_a_session_without_a_bridge_cannot_run_bridged(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        try:
            await sb.run_bridged(["true"])
        except ValueError as exc:
            assert "without a bridge" in str(exc)
        else:
            raise AssertionError("run_bridged ran without a bridge")


async def test_the_agent_opens_only_a_socket_of_its_socket_dir_as_a_bridge(
    pool: SandboxPool,
) -> None:
    async with pool.session() as sb:
        control = sb.sandbox.control
        limits = pool.config.limits.ceiling(pool.config.baseline_processes)
        sb.sandbox.handle.socket_dir.joinpath("b-plain.sock").write_text("not a socket")
        for bridge, error in (
            ("../agent.sock", "'bridge' must name"),
            ("agent.sock", "'bridge' must name"),
            ("b-missing.sock", "No such file"),
            ("b-plain.sock", "not a socket"),
        ):
            request = {"op": "open", "session": "probe", "limits": limits, "bridge": bridge}
            reply = await control.request(request, 10)
            assert not reply["ok"] and error in reply["error"], (bridge, reply)
