"""The persistent shell and the file tools of a session, on both backends.

State (cwd, variables, functions, history, background jobs) carries over between calls;
a timeout ends the foreground job only; background jobs die with the session; hostile
code in the background is contained and reported on the next call; an attacker's
background jobs cannot reach a neighbour's.
"""

from __future__ import annotations

import pytest

from sandbox import FileToolError, SandboxPool, Violation

# which sleeps of the test are alive, seen from inside the sandbox
# (NUL-separated argv records; the pattern does not match grep's own argv)
ALIVE = "grep -lz '^424[2]$' /proc/[0-9]*/cmdline 2>/dev/null | wc -l"


async def test_state_carries_over_between_calls(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.shell("mkdir -p a/b && cd a/b && export FOO=bar && greet() { echo hi $1; }")
        assert r.ok, r
        r = await sb.shell("pwd; echo $FOO; greet you; history")
        lines = r.stdout.splitlines()
        assert lines[0].endswith("/work/a/b") and lines[1:3] == ["bar", "hi you"], r
        assert "cd a/b" in lines[3] and "history" in lines[4] and len(lines) == 5, r
        r = await sb.shell("printf 'no newline'; false")
        assert (r.exit_code, r.stdout, r.violation) == (1, "no newline", Violation.NONE)
        r = await sb.shell("echo out; echo err >&2")
        assert r.stdout == "out\nerr\n" and r.stderr == ""  # one terminal, as a user sees it
        r = await sb.shell("exit 3")
        assert (r.exit_code, r.violation) == (3, Violation.NONE), r
        r = await sb.shell("pwd; echo ${FOO:-unset}")  # a fresh shell, in the work dir
        assert r.stdout.endswith("/work\nunset\n"), r


async def test_background_jobs_survive_calls_and_die_with_the_session(
    pool_factory,
) -> None:
    pool: SandboxPool = await pool_factory(max_sandboxes=1, sessions_per_sandbox=1, warm=0)
    async with pool.session() as sb:
        first = sb.sandbox
        r = await sb.shell("sleep 4242 & echo started")
        assert r.ok and r.stdout == "started\n", r
        r = await sb.run(["true"])  # a call of another kind sweeps only its own leftovers
        assert r.ok, r
        r = await sb.run_python("print(1)")
        assert r.ok, r
        r = await sb.shell(f"jobs; {ALIVE}")
        assert "Running" in r.stdout and r.stdout.endswith("1\n"), r
    async with pool.session() as sb:
        assert sb.sandbox is first  # same sandbox: its /proc would still show the sleep
        r = await sb.shell(ALIVE)
        assert r.stdout == "0\n", r


async def test_timeout_ends_the_foreground_job_only(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        assert (await sb.shell("sleep 4242 & X=1")).ok
        r = await sb.shell("sleep 30; echo not-reached", timeout=1)
        assert r.exit_code is None and r.violation is Violation.TIMEOUT, r
        assert "not-reached" not in r.stdout and r.duration_s < 5, r
        r = await sb.shell("while :; do :; done", timeout=1)  # bash itself busy
        assert r.violation is Violation.TIMEOUT, r
        r = await sb.shell(f"echo $X; jobs; {ALIVE}")
        assert r.ok and r.stdout.startswith("1\n[1]+  Running") and r.stdout.endswith("1\n"), r


async def test_output_is_capped_per_call(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(limits={"output_kb": 4})
    async with pool.session() as sb:
        r = await sb.shell("seq 1 100000; echo done")
        assert r.exit_code == 0 and r.stdout_truncated and len(r.stdout) == 4096, r
        assert r.stdout.startswith("1\n2\n") and r.violation is Violation.NONE
        r = await sb.shell("echo still here")
        assert r.stdout == "still here\n" and not r.stdout_truncated, r


async def test_a_background_fork_bomb_is_reported_on_the_next_call(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        r = await sb.shell("X=1; bomb() { bomb | bomb & }; bomb & echo launched")
        assert r.stdout.startswith("launched"), r
        seen = [r.violation]
        for _ in range(2):  # the bomb grows while the call returns: this call or the next
            if Violation.PROCESSES in seen:
                break
            seen.append((await sb.shell("sleep 0.5", timeout=10)).violation)
        assert seen[-1] is Violation.PROCESSES, seen
        r = await sb.shell("echo fresh:$X; jobs | wc -l", timeout=10)
        # the bomb's shell was killed with all it held; a fresh one answers
        assert r.ok and r.stdout == "fresh:\n0\n", r


async def test_an_attackers_background_jobs_cannot_reach_its_neighbour(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=4)
    async with pool.session() as victim, pool.session() as attacker:
        assert (await victim.shell("sleep 4242 & V=kept")).ok
        # in the background: kill everything it can signal, forever, and a fork bomb
        attack = "(while :; do kill -9 -1; done) 2>/dev/null & b() { b | b & }; b &"
        # its `kill -9 -1` takes its own session process too (same uid): session_lost
        seen = [(await attacker.shell(attack)).violation]
        for _ in range(3):  # or the bomb, seen on this call or a next one
            if seen[-1] is not Violation.NONE:
                break
            seen.append((await attacker.shell("sleep 0.5", timeout=10)).violation)
        assert seen[-1] in (Violation.PROCESSES, Violation.SESSION_LOST), seen
        r = await victim.shell("echo $V; jobs", timeout=10)
        assert r.ok and r.stdout == "kept\n[1]+  Running                 sleep 4242 &\n", r


async def test_file_tools(pool: SandboxPool) -> None:
    async with pool.session() as sb:
        await sb.write_file("pkg/mod.py", "X = 1\nY = 1\n")
        await sb.edit_file("pkg/mod.py", "X = 1", "X = 2")
        assert await sb.read_file("pkg/mod.py") == b"X = 2\nY = 1\n"
        assert await sb.list_dir() == ["pkg/"]
        assert await sb.list_dir("pkg") == ["mod.py"]
        r = await sb.shell("cat pkg/mod.py")  # the shell and the tools see one work dir
        assert r.stdout == "X = 2\nY = 1\n", r
        with pytest.raises(FileToolError, match="occurs 2 times"):
            await sb.edit_file("pkg/mod.py", " = ", "=")
        with pytest.raises(FileToolError, match="occurs 0 times"):
            await sb.edit_file("pkg/mod.py", "Z", "W")
        with pytest.raises(FileToolError, match="No such file"):
            await sb.read_file("missing.txt")
        with pytest.raises(ValueError, match="outside"):
            await sb.read_file("../etc/passwd")
        with pytest.raises(ValueError, match="outside"):
            await sb.write_file("/etc/x", "y")
        with pytest.raises(TypeError):
            await sb.edit_file("pkg/mod.py", "", "x")
        with pytest.raises(TypeError):
            await sb.shell(["ls"])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            await sb.shell("ls", timeout=0)
