"""Hostile code against both backends: each attack is contained and categorised, the
next call on the pool works, and the engine stays healthy."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from sandbox import SandboxPool, Violation

# Lists the sandbox's processes (pid, state, cmdline) from the code's point of view.
LIST_PROCS = """
import os
for p in sorted(os.listdir('/proc'), key=lambda s: (len(s), s)):
    if p.isdigit():
        try:
            stat = open(f'/proc/{p}/stat').read()
            cmd = open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode()
        except OSError:
            continue
        print(p, stat[stat.rindex(')') + 2], cmd)
"""


async def procs(pool: SandboxPool) -> list[tuple[int, str, str]]:
    async with pool.session() as s:
        r = await s.run_python(LIST_PROCS)
    assert r.ok, r
    rows = [line.split(" ", 2) for line in r.stdout.splitlines()]
    return [(int(p), st, cmd if cmd else "") for p, st, *rest in rows for cmd in [*rest, ""][:1]]


async def assert_pool_works(pool: SandboxPool) -> None:
    async with pool.session() as s:
        r = await s.run_python("print(6 * 7)")
    assert r.ok and r.stdout == "42\n", r
    if pool.config.backend == "docker":
        assert pool.backend.client.ping()


async def test_endless_loop_times_out(pool: SandboxPool) -> None:
    async with pool.session() as s:
        r = await s.run_python("while True: pass", timeout=1.0)
    assert r.violation is Violation.TIMEOUT
    assert r.exit_code is None
    assert 1.0 <= r.duration_s < 5.0
    await assert_pool_works(pool)


@pytest.mark.slow
async def test_fork_bomb_hits_the_process_limit(pool: SandboxPool) -> None:
    async with pool.session() as s:
        r = await s.run_python("import os\nwhile True:\n    os.fork()", timeout=3.0)
        assert r.violation is Violation.PROCESSES, r
        after = await s.run_python(LIST_PROCS)
    # agent, session, standby and the lister itself: every bomb process is gone
    assert len(after.stdout.splitlines()) <= 4, after.stdout
    await assert_pool_works(pool)


async def test_memory_bomb_hits_the_memory_limit(pool: SandboxPool) -> None:
    async with pool.session() as s:
        r = await s.run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))")
    assert r.violation is Violation.MEMORY, r
    assert "MemoryError" in r.stderr
    await assert_pool_works(pool)


async def test_gigabyte_on_stdout_is_capped(pool: SandboxPool) -> None:
    cap = pool.config.limits.output_kb << 10
    async with pool.session() as s:
        r = await s.run_python(
            "import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)"
        )
        assert r.violation is Violation.OUTPUT
        assert r.stdout_truncated and len(r.stdout) == cap
        sh = await s.run(["sh", "-c", "head -c 1073741824 /dev/zero | tr '\\0' y"])
    assert sh.violation is Violation.OUTPUT and len(sh.stdout) == cap
    assert r.duration_s < 10
    await assert_pool_works(pool)


async def test_network_is_unreachable(pool: SandboxPool) -> None:
    code = (
        "import socket\n"
        "print(open('/proc/net/dev').read().count(':'))\n"
        "socket.create_connection(('10.0.0.1', 80), timeout=3)\n"
    )
    async with pool.session() as s:
        r = await s.run_python(code)
    assert r.exit_code == 1 and "OSError" in r.stderr, r
    assert r.stdout.strip() == "1"  # loopback only
    await assert_pool_works(pool)


async def test_writing_outside_the_work_dir_fails(pool: SandboxPool) -> None:
    marker = f"rf-escape-{secrets.token_hex(4)}"
    targets = [
        f"/{marker}",
        f"/etc/{marker}",
        f"/usr/bin/{marker}",
        "/opt/agent/agent/control.py",
        f"/var/{marker}",
    ]
    code = (
        f"import os\nfor t in {targets!r}:\n"
        "    try:\n        open(t, 'a').write('x')\n        print('WROTE', t)\n"
        "    except OSError as e:\n        print('refused', t, e.errno)\n"
        "open('inside', 'w').write('ok')\nprint(open('inside').read())\n"
    )
    async with pool.session() as s:
        r = await s.run_python(code)
    assert "WROTE" not in r.stdout, r.stdout
    assert r.stdout.count("refused") == len(targets) and r.stdout.endswith("ok\n")
    for host_path in (Path("/") / marker, Path("/etc") / marker, Path("/usr/bin") / marker):
        assert not host_path.exists()
    await assert_pool_works(pool)


async def test_host_files_are_not_readable(pool: SandboxPool, tmp_path: Path) -> None:
    secret = secrets.token_hex(16)
    planted = [Path("/var/tmp") / f"rf-secret-{secret[:8]}", tmp_path / "secret"]
    for path in planted:
        path.write_text(secret)
    try:
        paths = [str(p) for p in planted] + ["/etc/shadow", "/root/.bash_history"]
        code = (
            f"for p in {paths!r}:\n    try:\n        print(open(p).read())\n"
            "    except OSError as e:\n        print('denied', p, e.errno)\n"
        )
        async with pool.session() as s:
            r = await s.run_python(code)
    finally:
        for path in planted:
            path.unlink()
    assert secret not in r.stdout
    assert r.stdout.count("denied") == 4, r.stdout
    await assert_pool_works(pool)


async def test_killing_the_parent_loses_only_that_call(pool: SandboxPool) -> None:
    async with pool.session() as s:
        await s.run_python("open('state', 'w').write('kept')")
        r = await s.run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
        assert r.violation is Violation.SESSION_LOST
        again = await s.run_python("print(open('state').read())")
        assert again.ok and again.stdout == "kept\n", again
        pid1 = await s.run_python(
            "import os, signal\ntry:\n    os.kill(1, signal.SIGKILL)\n"
            "except PermissionError:\n    print('refused')\nprint('alive')"
        )
        # PID 1 (the agent) ignores signals from inside; on docker it is another uid
        refused = "refused\n" if pool.config.backend == "docker" else ""
        assert pid1.stdout == refused + "alive\n", pid1
        everyone = await s.run_python("import os, signal\nos.kill(-1, signal.SIGKILL)")
        assert everyone.violation is Violation.SESSION_LOST
        last = await s.run_python("print('back')")
        assert last.ok and last.stdout == "back\n"
    await assert_pool_works(pool)


async def test_children_that_outlive_a_timeout_are_killed(pool: SandboxPool) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(300)\n    os._exit(0)\n"
        "time.sleep(300)\n"
    )
    async with pool.session() as s:
        r = await s.run_python(code, timeout=1.0)
        assert r.violation is Violation.TIMEOUT
        bg = await s.run(["sh", "-c", "sleep 300 & sleep 300 & echo started"])
        assert bg.ok and bg.stdout == "started\n"
        listing = await s.run_python(LIST_PROCS)
    assert "sleep" not in listing.stdout
    assert len(listing.stdout.splitlines()) <= 4, listing.stdout
    await assert_pool_works(pool)


async def test_zombies_do_not_pile_up(pool: SandboxPool) -> None:
    code = (
        "import os\nfor _ in range(50):\n    if os.fork() == 0:\n        os._exit(0)\nprint('left')"
    )
    async with pool.session() as s:
        for _ in range(3):
            r = await s.run_python(code)
            assert r.ok and r.stdout == "left\n"
        listing = await s.run_python(LIST_PROCS)
    states = [line.split(" ", 2)[1] for line in listing.stdout.splitlines()]
    assert "Z" not in states, listing.stdout
    assert len(states) <= 4
    await assert_pool_works(pool)


async def test_file_size_limit(pool: SandboxPool) -> None:
    limit = pool.config.limits.file_size_mb << 20
    async with pool.session() as s:
        r = await s.run_python(f"with open('big', 'wb') as f:\n    f.write(b'x' * {limit + 1})")
        assert r.violation is Violation.FILE_SIZE, r
        assert "File too large" in r.stderr
        sh = await s.run(["sh", "-c", f"head -c {limit + 1} /dev/zero > big2"])
        assert sh.violation is Violation.FILE_SIZE, sh
    await assert_pool_works(pool)
