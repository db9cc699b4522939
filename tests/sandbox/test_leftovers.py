"""A session leaves nothing behind, on both backends: no IPC object, no file outside its
work dir, no slot the next session cannot use, whatever it did to its tree; and on
Docker, where sessions share the agent, a refused fork does not take the agent down.

The next session lands where the attacker was (Docker: the same container and slot;
bwrap: the same jail), which each test checks before it looks.
"""

from __future__ import annotations

import json

import pytest

from sandbox import SandboxError, SandboxPool

# SysV shared memory, message queue and semaphore, a POSIX message queue, a /dev/shm file
IPC_MAKE = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
made = {}
shm = libc.shmget(0x5EED, 1 << 20, 0o1666)
made['shm'] = shm >= 0
if shm >= 0:
    ctypes.memset(libc.shmat(shm, None, 0), 1, 1 << 20)
made['msg'] = libc.msgget(0x5EED, 0o1666) >= 0
made['sem'] = libc.semget(0x5EED, 1, 0o1666) >= 0
made['mq'] = libc.mq_open(b'/farm-mq', os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
try:
    open('/dev/shm/farm-left', 'w').write('x')
    made['dev_shm'] = True
except OSError:
    made['dev_shm'] = False
print(json.dumps(made))
"""

IPC_SEEN = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
seen = {k: len(open('/proc/sysvipc/' + k).read().splitlines()) - 1 for k in ('shm', 'msg', 'sem')}
seen['mq'] = libc.mq_open(b'/farm-mq', os.O_RDONLY) >= 0
seen['dev_shm'] = os.path.exists('/dev/shm/farm-left')
print(json.dumps(seen))
"""
NOTHING = {"shm": 0, "msg": 0, "sem": 0, "mq": False, "dev_shm": False}


async def _attacker_then_next(pool: SandboxPool, attack: str, check: str) -> tuple[dict, dict]:
    """Run ``attack`` in a session beside a victim; then ``check`` in the victim while the
    attacker is open, and in the session that next takes the attacker's place."""
    async with pool.session() as victim:
        async with pool.session() as attacker:
            made = await attacker.run_python(attack)
            assert made.ok, made
            beside = await victim.run_python(check)
            assert beside.ok, beside
            where = attacker.sandbox
        async with pool.session() as after:
            assert after.sandbox is where  # the attacker's container (slot) or jail
            seen = await after.run_python(check)
    assert seen.ok, seen
    return json.loads(beside.stdout), json.loads(seen.stdout)


async def test_ipc_objects_are_private_and_die_with_the_session(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2, max_sandboxes=2, warm=0)
    async with pool.session() as probe:
        made = json.loads((await probe.run_python(IPC_MAKE)).stdout)
    # every kind could be made (/dev/shm is the session's own now): the checks below count
    assert made == {k: True for k in NOTHING}, made
    beside, after = await _attacker_then_next(pool, IPC_MAKE, IPC_SEEN)
    assert beside == NOTHING, beside
    assert after == NOTHING, after


# every place outside its work dir a session might write to
OUTSIDE = [
    "/tmp/farm-left",
    "/dev/farm-left",
    "/dev/shm/farm-left",
    "/run/agent/farm-left",
    "/run/farm-left",
    "/work/farm-left",
    "/var/tmp/farm-left",
]
WRITE_OUTSIDE = f"""
import json
for path in {OUTSIDE!r}:
    try:
        open(path, 'w').write('x')
    except OSError:
        pass
print(json.dumps({{}}))
"""
SEEN_OUTSIDE = f"""
import json, os
print(json.dumps({{p: os.path.exists(p) for p in {OUTSIDE!r}}}))
"""


async def test_nothing_written_outside_the_work_dir_outlives_the_session(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2, max_sandboxes=2, warm=0)
    beside, after = await _attacker_then_next(pool, WRITE_OUTSIDE, SEEN_OUTSIDE)
    assert not any(beside.values()), beside
    assert not any(after.values()), after
    for sandbox in pool._sandboxes:  # nor in the host's socket directories
        assert not (sandbox.handle.socket_dir / "farm-left").exists()


# a tree deeper than any recursion, the disk filled, modes taken away up to the slot root
RUIN_SLOT = """
import os
slot = os.path.dirname(os.getcwd())
os.mkdir('deep')
os.chdir('deep')
for _ in range(1500):
    os.mkdir('x')
    os.chdir('x')
open('f', 'w').write('x' * 4096)
os.chdir(slot + '/work')
n = 0
try:
    while True:
        with open(f'fill-{n}', 'wb') as f:
            f.write(b'y' * (8 << 20))
        n += 1
except OSError:
    pass
os.chmod('deep', 0)
os.chmod(slot + '/tmp', 0)
os.chmod(slot, 0)
print(n)
"""
FILL_AGAIN = """
import os
print(sorted(os.listdir('.')))
n = 0
for n in range(3):
    with open(f'again-{n}', 'wb') as f:
        f.write(b'z' * (8 << 20))
print('wrote', n + 1)
"""


async def test_a_slot_is_wiped_whatever_the_session_did_to_it(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(
        sessions_per_sandbox=1, max_sandboxes=1, warm=1, work_mb=32
    )
    async with pool.session() as attacker:
        ruined = await attacker.run_python(RUIN_SLOT, timeout=60)
        assert ruined.ok and int(ruined.stdout) >= 2, ruined
        where = attacker.sandbox
    async with pool.session() as after:
        assert after.sandbox is where
        r = await after.run_python(FILL_AGAIN)
    assert r.ok, r
    assert r.stdout == "[]\nwrote 3\n", r  # nothing left, and the disk is free again


@pytest.mark.docker
async def test_the_agent_survives_a_refused_fork(docker_pool_factory) -> None:
    """Docker only: there sessions share the agent (PID 1 of the container), and one
    session can use up the container's pids, so neither a new session nor the wipe of a
    closed one can be forked. On bwrap the agent serves one session at a time and forks
    only once that session's processes are gone."""
    pool: SandboxPool = await docker_pool_factory(
        sessions_per_sandbox=4, max_sandboxes=1, warm=1, pids=48, limits={"processes": 400}
    )
    # takes every pid of the container, and each one freed again at once
    hog = (
        "python3 -c 'import os, time\n"
        "while True:\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        time.sleep(0.002)\n"
        "        continue\n"
        "    if pid == 0:\n        time.sleep(300)\n        os._exit(0)\n"
        "' >/dev/null 2>&1 & sleep 3; echo held"
    )
    async with pool.session() as victim, pool.session() as attacker:
        bystander = await pool.acquire()
        assert (await victim.run_python("print('up')")).ok
        held = await attacker.shell(hog, timeout=20)
        assert held.stdout.endswith("held\n"), held
        with pytest.raises(SandboxError, match=r"could not|Resource"):
            await pool.acquire()  # the agent cannot fork a session now; it says so
        # nor the child that wipes a closed slot: the close fails, the container will go
        await pool.release(bystander)
        assert victim.sandbox.draining
        ping = await victim.sandbox.control.request({"op": "ping"}, 10)
        assert ping["ok"] and ping["pid"] == 1 and ping["sessions"] == 2, ping
        r = await victim.run_python("print('still here')")
        assert r.ok and r.stdout == "still here\n", r
    async with pool.session() as again:  # a fresh container once the old one emptied
        assert (await again.run_python("print(1)")).ok
