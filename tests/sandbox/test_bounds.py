"""Every resource a session can take is bounded, on both backends: what the file tools
read, its memory (files on tmpfs and shared memory included), the output its shell
drains, its CPU against a busy neighbour, its pseudo-terminals."""

from __future__ import annotations

import asyncio
import re

import pytest

from sandbox import FileToolError, SandboxPool
from tests.sandbox.test_hostile import LIST_PROCS

# the session process's peak memory, seen from a call (its parent: the session process)
SESSION_PEAK = """
import os
status = open(f'/proc/{os.getppid()}/status').read()
print(int(status.split('VmHWM:')[1].split()[0]) >> 10)
"""


async def test_the_file_tools_read_at_most_the_cap(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(work_mb=96)
    async with pool.session() as s:
        big = await s.shell("head -c 48000000 /dev/zero | tr '\\0' a > big; echo made")
        assert big.stdout == "made\n", big
        before = int((await s.run(["python3", "-c", SESSION_PEAK])).stdout)
        with pytest.raises(FileToolError, match="larger than"):
            await s.edit_file("big", "a", "b")
        data = await s.read_file("big")
        assert len(data) == pool.config.limits.collect_kb << 10
        after = int((await s.run(["python3", "-c", SESSION_PEAK])).stdout)
    # the session process never held the file: its peak grew by about the cap at most
    assert after - before < 32, (before, after)


# pins what it can: its disk full, then SysV shared memory, touched and detached (so no
# process's address-space limit counts it) and never removed, printing the MiB pinned
PIN = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
n = 0
try:
    while True:
        with open(f'fill-{n}', 'wb') as f:
            f.write(b'y' * (8 << 20))
        n += 1
except OSError:
    pass
print('disk', n * 8, flush=True)
pinned, chunk = 0, 32 << 20
while pinned < 1024 << 20:
    shm = libc.shmget(0, chunk, 0o1600)
    addr = libc.shmat(shm, None, 0) if shm >= 0 else None
    if addr in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(addr, 7, chunk)
    libc.shmdt(ctypes.c_void_p(addr))
    pinned += chunk
    print('shm', pinned >> 20, flush=True)
"""
GRAB = "x = b'v' * ({mb} << 20)\nprint(len(x) >> 20)"


async def test_a_session_cannot_take_a_neighbours_memory(pool_factory) -> None:
    # docker: two sessions of 256 MiB in one 576 MiB container; bwrap: a 576 MiB jail each
    pool: SandboxPool = await pool_factory(
        sessions_per_sandbox=2, memory_mb=576, work_mb=64, max_sandboxes=2
    )
    share = 256 if pool.config.backend == "docker" else 576  # a session's, a jail's
    async with pool.session() as victim:
        async with pool.session() as attacker:
            r = await attacker.run_python(PIN, timeout=60)
            disk = int(re.findall(r"disk (\d+)", r.stdout)[0])
            pinned = max(map(int, re.findall(r"shm (\d+)", r.stdout) or ["0"]))
            assert disk + pinned <= share, r  # its memory stops at its share
            grab = await victim.run_python(GRAB.format(mb=200))  # within its own share
            assert grab.ok and grab.stdout == "200\n", grab
        # closed: what it pinned is free again, for the victim and for whoever comes next
        async with pool.session() as after:
            both = await asyncio.gather(
                victim.run_python(GRAB.format(mb=200)), after.run_python(GRAB.format(mb=200))
            )
    assert all(g.ok and g.stdout == "200\n" for g in both), both


async def test_background_output_cannot_flood_the_shell(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=1, max_sandboxes=1, warm=1)
    flood = "for i in 1 2; do (head -c 48000000 /dev/zero | tr '\\0' x; echo) & done; echo go"
    async with pool.session() as s:
        r = await s.shell(flood)
        assert r.ok and "go" in r.stdout, r
        for _ in range(8):  # each ends at once, its output capped (the flood fills it)
            r = await s.shell("echo ok", timeout=10)
            assert r.ok and r.duration_s < 5, r
            assert len(r.stdout) <= pool.config.limits.output_kb << 10
        where = s.sandbox
    async with pool.session() as after:
        assert after.sandbox is where
        listing = await after.run_python(LIST_PROCS)
    assert listing.ok and "head" not in listing.stdout and "tr" not in listing.stdout, listing
    assert len(listing.stdout.splitlines()) <= 4, listing.stdout


BUSY = "import time\nt = time.perf_counter()\nn = 0\nwhile n < 2_000_000:\n    n += 1\n"
BUSY += "print(time.perf_counter() - t)"


# alone: a claim on timing (beside the other pytest worker the docker case once measured 4.1x)
@pytest.mark.alone
@pytest.mark.slow
async def test_a_busy_neighbour_slows_a_session_at_most_by_its_share(pool_factory) -> None:
    """Sessions busy at once share the sandbox's CPU evenly (a cgroup each, equal
    weights): with one busy neighbour a call takes at most about twice as long as
    alone, whatever the neighbour runs in the background (24 busy loops here)."""
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2, max_sandboxes=2, cpus=1.0)
    async with pool.session() as victim, pool.session() as attacker:
        alone = min([float((await victim.run_python(BUSY)).stdout) for _ in range(3)])
        loops = "for i in $(seq 24); do (while :; do :; done) & done; echo spinning"
        assert (await attacker.shell(loops)).stdout.endswith("spinning\n")
        await asyncio.sleep(0.5)
        busy = min([float((await victim.run_python(BUSY)).stdout) for _ in range(3)])
    # the bound is 2x; the rest is room for the other load of a shared test machine
    assert busy < 4 * alone, (alone, busy)


OPEN_PTYS = """
import os
held = []
try:
    for _ in range(64):
        held.append(os.openpty())
except OSError as exc:
    print(len(held), exc.errno)
else:
    print(len(held), 0)
"""


async def test_a_session_holds_at_most_its_ptys(pool: SandboxPool) -> None:
    async with pool.session() as s:
        r = await s.run_python(OPEN_PTYS)
        # its interpreter still holds them all: no pty is left for its shell, which is
        # the model's doing (an answer, not a failure of the sandbox)
        shell = await s.shell("echo shell")
    count, errno = map(int, r.stdout.split())
    assert count <= 16 and errno == 28, r  # ENOSPC: devpts max=
    assert shell.exit_code == 126 and "No space left" in shell.stdout, shell
