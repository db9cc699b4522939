"""The agent's control channel is out of every session's reach, on both backends.

An attacker session tries the agent's socket and the session sockets (on bwrap they used
to sit in a directory the session could write, under its own uid), plants links to its
session process's descriptors and to devices for the file tools to follow, and a frame
that sends inflated limits is clamped to those the session was opened with.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sandbox import FileToolError, SandboxPool
from sandbox.agent.wire import encode_frame

# every socket it can find under /run/agent, asked to open a session of its own
CONTROL_ATTACK = """
import json, os, socket, struct
limits = dict(cpu_s=9999, memory_bytes=1 << 40, processes=100000, file_size_bytes=1 << 40,
              open_files=65536, output_bytes=1 << 26, collect_bytes=1 << 26)
paths = ['/run/agent/agent.sock']
try:
    paths += ['/run/agent/' + n for n in os.listdir('/run/agent') if n.endswith('.sock')]
except OSError:
    pass
out = {}
for path in sorted(set(paths)):
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(path)
        body = json.dumps({'op': 'open', 'session': 'evil1', 'limits': limits}).encode()
        s.sendall(struct.pack('>I', len(body)) + body)
        out[path] = 'ANSWERED ' + s.recv(4096)[4:].decode(errors='replace')
    except OSError as exc:
        out[path] = 'denied: ' + type(exc).__name__
print(json.dumps(out))
"""


async def test_sessions_cannot_reach_the_agents_sockets(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2)
    async with pool.session() as victim, pool.session() as attacker:
        assert (await victim.run_python("open('mine', 'w').write('v')")).ok
        r = await attacker.run_python(CONTROL_ATTACK)
        assert r.ok, r
        probes = json.loads(r.stdout)
        assert probes and all(v.startswith("denied") for v in probes.values()), probes
        for sandbox in pool._sandboxes:  # no agent serves a session behind the pool's back
            ping = await sandbox.control.request({"op": "ping"}, 10)
            assert ping["sessions"] == len(sandbox.sessions), (ping, sandbox.sessions)
        mine = await victim.run_python("print(open('mine').read())")
    assert mine.ok and mine.stdout == "v\n", mine


# links to the session process's own descriptors (the spare child's control pipe among
# them), to a device, and a FIFO: the file tools must open none of them
PLANT = """
import os
for n in range(3, 48):
    os.symlink(f'/proc/self/fd/{n}', f'fd{n}')
os.symlink('/dev/zero', 'zero')
os.symlink('/etc/passwd', 'passwd')
os.mkdir('real')
os.symlink('real', 'dirlink')
os.mkfifo('fifo')
print(os.getcwd())
"""


async def test_file_tools_follow_no_link_and_open_only_regular_files(pool: SandboxPool) -> None:
    async with pool.session() as s:
        assert (await s.run(["true"])).ok  # a spare child now waits on its control pipe
        planted = await s.run_python(PLANT)
        assert planted.ok, planted
        cwd = planted.stdout.strip()
        limits = dict(pool.config.limits.wire(5), memory_bytes=1 << 40, processes=100000)
        frame = encode_frame(
            {"argv": ["sh", "-c", "ulimit -v > pwned"], "limits": limits, "workdir": cwd}
        )
        for n in range(3, 48):
            with pytest.raises(FileToolError, match="link"):
                await s.write_file(f"fd{n}", frame)
        for name in ("zero", "passwd", "fifo"):
            with pytest.raises(FileToolError, match=r"link|regular"):
                await asyncio.wait_for(s.read_file(name), 10)
            with pytest.raises(FileToolError, match=r"link|regular"):
                await asyncio.wait_for(s.edit_file(name, "root", "toor"), 10)
        with pytest.raises(FileToolError, match="not a directory"):
            await s.write_file("dirlink/x", "y")
        with pytest.raises(FileToolError, match="not a directory"):
            await s.list_dir("dirlink")
        await asyncio.sleep(0.5)  # what a fed spare child would have done by now
        listing = await s.list_dir()
        assert "pwned" not in listing and "dirlink" in listing, listing


async def test_a_frame_cannot_raise_the_limits_its_session_was_opened_with(
    pool: SandboxPool,
) -> None:
    code = (
        "import resource\n"
        "print(resource.getrlimit(resource.RLIMIT_AS)[0], "
        "resource.getrlimit(resource.RLIMIT_NPROC)[0])"
    )
    inflated = dict(pool.config.limits.wire(5), memory_bytes=1 << 40, processes=100000)
    async with pool.session() as s:
        for mode in ("fork", "persistent"):
            request = {"op": "run", "code": code, "mode": mode, "timeout": 5, "limits": inflated}
            reply = await s.connection.request(request, 20)
            assert reply["ok"] and reply["exit_code"] == 0, reply
            memory, processes = map(int, reply["stdout"].split())
            # what the pool opened the session with: its configured limits
            assert memory == pool.config.limits.memory_mb << 20, reply
            assert processes < 100000, reply
