"""Pool behaviour on both backends: warm-up, acquire, recycling, reaping of leftovers,
session state, strict isolation."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbox import AcquireTimeout, SandboxConfig, SandboxPool, Violation
from sandbox.backends import owner_token
from tests.sandbox.conftest import SOCKET_DIR, require_backend

Factory = Callable[..., Any]


async def test_warm_sandboxes_are_ready_and_acquire_uses_them(pool_factory: Factory) -> None:
    pool = await pool_factory(warm=2, sessions_per_sandbox=1)
    assert pool.stats()["idle"] == 2
    names = {sb.handle.name for sb in pool._sandboxes}
    async with pool.session() as a, pool.session() as b:
        assert {a.sandbox.handle.name, b.sandbox.handle.name} == names  # no cold start
        assert pool.stats()["busy"] == 2


async def test_session_state_persists_across_calls(pool: SandboxPool) -> None:
    async with pool.session() as s:
        await s.run_python("open('counter', 'w').write('1')")
        await s.run_python(
            "n = int(open('counter').read()); open('counter', 'w').write(str(n + 1))"
        )
        r = await s.run(["cat", "counter"])
        assert r.stdout == "2"
        mod = await s.run_python(
            "import helper; print(helper.VALUE)", files={"helper.py": "VALUE = 'from file'"}
        )
        assert mod.stdout == "from file\n"
        io = await s.run_python(
            "import sys; open('out/result.txt', 'w').write(sys.stdin.read()[::-1])",
            stdin="abc",
            files={"out/.keep": b""},
            collect=["out/result.txt", "missing.txt"],
        )
        assert io.files == {"out/result.txt": b"cba"}
        with pytest.raises(ValueError):
            await s.run_python("1", files={"../escape": "x"})
        with pytest.raises(ValueError):
            await s.run(["cat"], collect=["/etc/passwd"])


async def test_sessions_sharing_a_sandbox_have_separate_work_dirs(pool_factory: Factory) -> None:
    pool = await pool_factory(sessions_per_sandbox=4)
    async with pool.session() as a, pool.session() as b:
        # docker packs them into one container (a uid each); bwrap gives each its jail
        assert (a.sandbox is b.sandbox) == (pool.config.backend == "docker")
        await a.run_python("open('mine', 'w').write('a')")
        r = await b.run_python("import os; print(os.path.exists('mine'), os.getcwd())")
        pwd_a = (await a.run_python("import os; print(os.getcwd())")).stdout
        assert r.stdout.split()[0] == "False" and r.stdout.split()[1] != pwd_a.strip()


async def test_strict_isolation_puts_each_session_in_its_own_sandbox(
    pool_factory: Factory,
) -> None:
    pool = await pool_factory(sessions_per_sandbox=1, warm=0, max_sandboxes=2)
    async with pool.session() as a, pool.session() as b:
        assert a.sandbox is not b.sandbox
        await a.run_python("import time; open('/tmp/a-was-here', 'w').write('1')")
        r = await b.run_python(
            "import os; print(os.path.exists('/tmp/a-was-here'), "
            "sum(p.isdigit() for p in os.listdir('/proc')))"
        )
        seen, nprocs = r.stdout.split()
        assert seen == "False" and int(nprocs) <= 4  # b sees none of a's processes


async def test_acquire_times_out_when_the_pool_is_full(pool_factory: Factory) -> None:
    pool = await pool_factory(
        sessions_per_sandbox=1, warm=1, max_sandboxes=1, acquire_timeout_s=0.5
    )
    async with pool.session():
        with pytest.raises(AcquireTimeout):
            async with pool.session():
                pass
    async with pool.session() as s:  # the slot came back
        assert (await s.run_python("print(1)")).ok


async def test_waiters_get_the_slot_when_it_frees(pool_factory: Factory) -> None:
    pool = await pool_factory(sessions_per_sandbox=1, warm=1, max_sandboxes=1)

    async def hold() -> None:
        async with pool.session() as s:
            await s.run_python("import time; time.sleep(0.3)")

    async def wait_then_run() -> str:
        await asyncio.sleep(0.05)
        async with pool.session() as s:
            return (await s.run_python("print('got it')")).stdout

    _, out = await asyncio.gather(hold(), wait_then_run())
    assert out == "got it\n"


async def test_recycle_after_n_sessions_and_after_a_violation(pool_factory: Factory) -> None:
    pool = await pool_factory(sessions_per_sandbox=1, recycle_after=2, warm=1)
    names = []
    for _ in range(3):
        async with pool.session() as s:
            names.append(s.sandbox.handle.name)
    assert names[0] == names[1] != names[2]
    async with pool.session() as s:
        before = s.sandbox.handle.name
        r = await s.run_python("while True: pass", timeout=0.5)
        assert r.violation is Violation.TIMEOUT
    async with pool.session() as s:
        assert s.sandbox.handle.name != before
        assert (await s.run_python("print('fresh')")).stdout == "fresh\n"


async def test_unhealthy_idle_sandbox_is_replaced(pool_factory: Factory) -> None:
    pool = await pool_factory(warm=1, health_interval_s=0.2)
    victim = pool._sandboxes[0]
    await pool.backend.stop(victim.handle)  # the sandbox dies behind the pool's back
    async with asyncio.timeout(30):
        # the maintainer has no event to offer a test: poll the pool's own view
        while victim in pool._sandboxes or pool.stats()["idle"] < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    async with pool.session() as s:
        assert s.sandbox is not victim and (await s.run_python("print(1)")).ok


async def test_leftovers_of_a_crashed_pool_are_reaped(backend: str) -> None:
    """What a crashed pool leaves (a labelled container, a socket directory, both naming
    an owner process that is gone) is removed when the next pool starts. The crash is
    made by writing the dead owner's token, since this test process must live on."""
    config = SandboxConfig(backend=backend, warm=0, socket_dir=SOCKET_DIR)
    dead = f"{owner_token().split(':')[0]}:999999999:1"
    pool_dir = SOCKET_DIR / f"dead{secrets.token_hex(2)}"
    (pool_dir / "1").mkdir(parents=True)
    (pool_dir / "owner").write_text(dead)
    name = f"rf-leftover-{secrets.token_hex(3)}"
    if backend == "docker":
        from sandbox.docker_backend import DockerBackend

        crashed = DockerBackend(config, dead)
        await crashed.prepare()
        await crashed.start(name, config.uid_base, pool_dir / "1")
        await crashed.close()
    async with SandboxPool(config) as fresh:
        assert not pool_dir.exists()
        if backend == "docker":
            from docker.errors import NotFound

            with pytest.raises(NotFound):
                fresh.backend.client.containers.get(name)


async def test_close_removes_every_container(pool_factory: Factory, backend: str) -> None:
    pool = await pool_factory(warm=2, sessions_per_sandbox=1)
    names = [sb.handle.name for sb in pool._sandboxes]
    await pool.close()
    if backend == "docker":
        import docker

        client = docker.from_env()
        try:
            left = client.containers.list(all=True, filters={"label": "rollout-farm.sandbox"})
            assert not set(names) & {c.name for c in left}
        finally:
            client.close()
    assert not pool.dir.exists()


async def test_unsafe_backend_is_explicit_and_loud(caplog: pytest.LogCaptureFixture) -> None:
    require_backend("bwrap")  # same host prerequisites (Linux, a python3)
    caplog.set_level(logging.WARNING)
    config = SandboxConfig(backend="unsafe-no-isolation", warm=0, socket_dir=SOCKET_DIR)
    async with SandboxPool(config) as pool, pool.session() as s:
        assert (await s.run_python("print('unsandboxed')")).stdout == "unsandboxed\n"
    warned = [r.message for r in caplog.records if "unsafe-no-isolation" in r.message]
    assert warned and "NO ISOLATION" in warned[0]  # also none between its sessions
    assert SandboxConfig().backend == "docker"  # never the silent default


async def test_a_burst_of_acquires_shares_a_starting_sandbox(pool_factory: Factory) -> None:
    pool = await pool_factory(warm=0, sessions_per_sandbox=8, max_sandboxes=4)

    async def one() -> str:
        async with pool.session() as s:
            await s.run_python("import time; time.sleep(0.2)")
            return s.sandbox.handle.name

    names = await asyncio.gather(*(one() for _ in range(8)))
    # docker: one container shares its slots; bwrap: a jail per session, never past the cap
    assert len(set(names)) == (1 if pool.config.backend == "docker" else 4)


async def test_metrics_follow_the_pool(pool_factory: Factory) -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    pool = await pool_factory(warm=1, sessions_per_sandbox=1)
    timeouts = sample("farm_sandbox_violations_total", kind="timeout")
    recycled = sample("farm_sandbox_containers_recycled_total")
    runs = sample("farm_sandbox_run_seconds_count")
    async with pool.session() as s:
        assert sample("farm_sandbox_containers", state="busy") == 1
        assert sample("farm_sandbox_sessions_active") >= 1
        await s.run_python("while True: pass", timeout=0.3)
    assert sample("farm_sandbox_violations_total", kind="timeout") == timeouts + 1
    assert sample("farm_sandbox_containers_recycled_total") == recycled + 1
    assert sample("farm_sandbox_run_seconds_count") == runs + 1
    assert sample("farm_sandbox_acquire_seconds_count") >= 1


async def test_large_stdin_code_and_files_round_trip(pool: SandboxPool) -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    code = (
        "import sys\nDATA = "
        + repr("z" * 200_000)
        + "\n"
        + (
            "raw = sys.stdin.buffer.read()\nopen('copy.bin', 'wb').write(raw)\nprint(len(raw), len(DATA))"
        )
    )
    async with pool.session() as s:
        r = await s.run_python(code, stdin=blob, collect=["copy.bin"])
        assert r.ok and r.stdout == f"{len(blob)} 200000\n", r
        assert r.files["copy.bin"] == blob
        sh = await s.run(["sha256sum", "copy.bin"], files={"x": blob})
        assert sh.ok and len(sh.stdout.split()[0]) == 64


async def test_a_released_session_refuses_calls(pool: SandboxPool) -> None:
    from sandbox import PoolClosed

    async with pool.session() as s:
        pass
    with pytest.raises(PoolClosed):
        await s.run_python("print(1)")


@pytest.mark.bwrap
@pytest.mark.parametrize("kind", ["bwrap", "unsafe-no-isolation"])
async def test_jails_die_with_a_crashed_pool_process(kind: str) -> None:
    """A pool process that dies without close() (os._exit) takes its jails with it."""
    import subprocess
    import sys
    import time

    require_backend("bwrap")
    script = (
        "import asyncio, os\nfrom sandbox import SandboxConfig, SandboxPool\n"
        "async def main():\n"
        f"    pool = SandboxPool(SandboxConfig(backend={kind!r}, warm=1, socket_dir={str(SOCKET_DIR)!r}))\n"
        "    await pool.start()\n"
        "    print(pool._sandboxes[0].handle.native.pid, flush=True)\n"
        "    os._exit(0)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    state = ""
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            state = "gone"
            break
        state = stat[stat.rindex(")") + 2]
        if state == "Z":
            break
        await asyncio.sleep(0.1)
    assert state in ("gone", "Z"), f"jail {pid} outlived its pool ({state})"


@pytest.mark.bwrap
async def test_orphaned_jails_of_dead_pools_are_killed_at_start() -> None:
    import subprocess

    require_backend("bwrap")
    pool_dir = SOCKET_DIR / f"dead{secrets.token_hex(2)}"
    (pool_dir / "1").mkdir(parents=True)
    (pool_dir / "owner").write_text(f"{owner_token().split(':')[0]}:999999999:1")
    jail = (
        "bwrap --ro-bind /usr /usr --symlink usr/lib /lib --symlink usr/lib64 /lib64 "
        f"--bind {pool_dir / '1'} /run/agent /usr/bin/sleep 60 >/dev/null 2>&1 & echo $!"
    )
    pid = int(subprocess.run(["sh", "-c", jail], capture_output=True, text=True).stdout)
    assert Path(f"/proc/{pid}").exists()  # orphaned: its shell has exited
    config = SandboxConfig(backend="bwrap", warm=0, socket_dir=SOCKET_DIR)
    async with SandboxPool(config):
        pass
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists():
            break
        await asyncio.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the orphaned jail survived"


@pytest.mark.bwrap
def test_bwrap_sessions_run_on_uvloop_as_the_workers_do() -> None:
    """Workers run on uvloop, whose subprocess API takes no user/group kwargs: the jail's
    uid switch must not depend on them."""
    import uvloop

    require_backend("bwrap")

    async def one_call() -> tuple[str, int]:
        config = SandboxConfig(backend="bwrap", warm=1, socket_dir=SOCKET_DIR)
        async with SandboxPool(config) as pool, pool.session() as session:
            result = await session.run_python("import os; print(os.getuid())")
        return result.stdout.strip(), result.exit_code

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        uid, code = runner.run(one_call())
    assert code == 0 and uid.isdigit()
    if os.geteuid() == 0:
        assert int(uid) != 0  # dropped to the jail's own uid
