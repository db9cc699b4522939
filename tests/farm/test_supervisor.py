"""The supervisor with real child processes: restart with backoff, give-up, finish, stop.

Children are small Python programs; nothing is mocked. Each test checks what an
operator relies on: prefixed output, restarts counted in the metrics, and no
process (child or grandchild) left behind on any path out of `run()`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from farm.errors import ChildFailed, StartupError
from farm.metrics import RESTARTS
from farm.supervisor import ProcessSpec, RestartPolicy, Supervisor

FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, window_s=30)


class Lines:
    """A line sink that keeps everything."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def __call__(self, name: str, text: str) -> None:
        self.lines.append((name, text))
        self.changed.set()

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self.changed.clear()
            await self.changed.wait()

    def of(self, name: str) -> list[str]:
        return [t for n, t in self.lines if n == name]

    def pid(self, name: str) -> int:
        started = [t for t in self.of("farm") if t.startswith(f"{name} started (pid ")]
        return int(started[-1].split("pid ")[1].rstrip(")"))


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; reaped zombies vanish from /proc.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _gone(pid: int, limit_s: float = 5.0) -> bool:
    """True once `pid` is dead; SIGKILL to a process group is delivered asynchronously."""
    deadline = time.monotonic() + limit_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(300)"


async def test_crashed_child_is_restarted_with_backoff_and_counted(tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    flaky = (
        "import pathlib, sys, time\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) + 1 if p.exists() else 1\n"
        "p.write_text(str(n))\n"
        "print(f'start {n}', flush=True)\n"
        "sys.exit(3) if n < 3 else time.sleep(300)\n"
    )
    sink = Lines()
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, max_restarts=3, window_s=30)
    sup = Supervisor([ProcessSpec("flaky", _py(flaky))], sink, policy)
    before = RESTARTS.labels(process="flaky")._value.get()

    async def stop_when_third_start(stop: asyncio.Event) -> None:
        await sink.until(lambda: "start 3" in sink.of("flaky"))
        sup.request_stop("test done")

    await asyncio.wait_for(sup.run(stop_when_third_start), 30)
    assert sink.of("flaky") == ["start 1", "start 2", "start 3"]
    assert sup.child("flaky").restarts == 2
    assert RESTARTS.labels(process="flaky")._value.get() - before == 2
    crashes = [t for t in sink.of("farm") if "exited with status 3" in t]
    assert crashes == [
        "flaky exited with status 3; restart in 0.1s",
        "flaky exited with status 3; restart in 0.2s",  # doubled
    ]
    assert not _alive(sink.pid("flaky"))


async def test_a_child_that_keeps_crashing_stops_the_farm(tmp_path: Path) -> None:
    sink = Lines()
    specs = [
        ProcessSpec("steady", _py(SLEEPER)),
        ProcessSpec("broken", _py("import sys; print('boom', flush=True); sys.exit(2)")),
    ]
    sup = Supervisor(specs, sink, FAST)
    with pytest.raises(ChildFailed, match="broken exited 4 times"):
        await asyncio.wait_for(sup.run(), 30)
    assert sink.of("broken").count("boom") == 4  # the first run and three restarts
    assert not _alive(sink.pid("steady")), "the healthy child must be stopped too"


async def test_a_fatal_exit_stops_the_farm_at_once_with_the_childs_error_line() -> None:
    sink = Lines()
    bad_input = (
        "import sys\n"
        "print('2026-01-01 00:00:00,000 INFO learner starting', flush=True)\n"
        "print('2026-01-01 00:00:00,001 ERROR learner tasks.jsonl:3: bad env_spec', flush=True)\n"
        "print('shutting down', flush=True)\n"
        "sys.exit(2)\n"
    )
    specs = [
        ProcessSpec("steady", _py(SLEEPER)),
        ProcessSpec("learner", _py(bad_input), fatal_exit_codes=frozenset({2, 3})),
    ]
    sup = Supervisor(specs, sink, FAST)
    with pytest.raises(ChildFailed) as caught:
        await asyncio.wait_for(sup.run(), 30)
    assert str(caught.value) == (
        "learner exited with status 2 (not restarted): learner tasks.jsonl:3: bad env_spec"
    )
    assert sup.child("learner").restarts == 0 and sink.of("learner").count("shutting down") == 1
    assert not _alive(sink.pid("steady"))


async def test_a_finishing_child_ends_the_farm_and_stops_the_rest() -> None:
    sink = Lines()
    specs = [
        ProcessSpec("server", _py(SLEEPER)),
        ProcessSpec("trainer", _py("print('trained', flush=True)"), finishes_stack=True),
    ]
    sup = Supervisor(specs, sink, FAST)
    await asyncio.wait_for(sup.run(), 30)
    assert sup.stop_reason == "trainer finished"
    assert sup.child("trainer").restarts == 0
    assert not _alive(sink.pid("server"))


async def test_stop_reaches_grandchildren_and_kills_what_ignores_sigterm() -> None:
    stubborn = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "print(f'grandchild {g.pid}', flush=True)\n"
        "time.sleep(300)\n"
    )
    sink = Lines()
    spec = ProcessSpec("stubborn", _py(stubborn), stop_timeout_s=0.5)
    sup = Supervisor([spec], sink, FAST)

    async def stop_once_grandchild_runs(stop: asyncio.Event) -> None:
        await sink.until(lambda: bool(sink.of("stubborn")))
        sup.request_stop("test done")

    await asyncio.wait_for(sup.run(stop_once_grandchild_runs), 60)
    grandchild = int(sink.of("stubborn")[0].split()[1])
    assert "stubborn ignored SIGTERM; killing it" in sink.of("farm")
    assert not _alive(sink.pid("stubborn"))
    assert _gone(grandchild)


async def test_children_start_in_order_once_the_previous_one_is_ready(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    first = f"import pathlib, time\ntime.sleep(0.5)\npathlib.Path({str(flag)!r}).touch()\ntime.sleep(300)"
    second = f"import pathlib\nprint(pathlib.Path({str(flag)!r}).exists(), flush=True)\nimport time; time.sleep(300)"

    async def first_ready() -> bool:
        return flag.exists()

    sink = Lines()
    specs = [
        ProcessSpec("first", _py(first), ready=first_ready),
        ProcessSpec("second", _py(second)),
    ]
    sup = Supervisor(specs, sink, FAST)

    async def stop_when_second_spoke(stop: asyncio.Event) -> None:
        await sink.until(lambda: bool(sink.of("second")))
        sup.request_stop("test done")

    await asyncio.wait_for(sup.run(stop_when_second_spoke), 30)
    assert sink.of("second") == ["True"], "second started before first was ready"


async def test_children_after_an_ungated_child_start_while_it_loads(tmp_path: Path) -> None:
    # The server is ready only once the test says so, after the client has spoken: the
    # client cannot have waited for it. Start-up completes only with the server ready.
    flag = tmp_path / "ready"

    async def server_ready() -> bool:
        return flag.exists()

    sink = Lines()
    specs = [
        ProcessSpec("server", _py(SLEEPER), ready=server_ready, gate_start=False),
        ProcessSpec("client", _py(SLEEPER)),
    ]
    sup = Supervisor(specs, sink, FAST)

    async def stop_once_started(stop: asyncio.Event) -> None:
        sup.request_stop("test done")

    run = asyncio.create_task(sup.run(stop_once_started))
    await asyncio.wait_for(sink.until(lambda: sink.of("client") == ["up"]), 30)
    assert not sup.started.is_set()
    flag.touch()
    await asyncio.wait_for(run, 30)
    farm = sink.of("farm")
    assert farm.index(f"client started (pid {sink.pid('client')})") < farm.index(
        "all processes started"
    )
    assert sup.stop_reason == "test done"


async def test_the_children_of_a_start_group_stop_together(tmp_path: Path) -> None:
    # Each one, on SIGTERM, waits (up to 20 s) for its peer's SIGTERM before it exits:
    # stopped one after the other, the first would not see the second's.
    def peer(me: str, other: str) -> tuple[str, ...]:
        code = (
            "import pathlib, signal, sys, time\n"
            f"mine, theirs = pathlib.Path({str(tmp_path / me)!r}), "
            f"pathlib.Path({str(tmp_path / other)!r})\n"
            "def stop(*_):\n"
            "    mine.touch()\n"
            "    deadline = time.monotonic() + 20\n"
            "    while not theirs.exists() and time.monotonic() < deadline:\n"
            "        time.sleep(0.02)\n"
            "    print('saw peer' if theirs.exists() else 'alone', flush=True)\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('up', flush=True)\n"
            "while True:\n"
            "    time.sleep(1)\n"
        )
        return _py(code)

    sink = Lines()
    specs = [
        ProcessSpec("a", peer("a", "b"), start_group="pair", stop_timeout_s=30),
        ProcessSpec("b", peer("b", "a"), start_group="pair", stop_timeout_s=30),
    ]
    sup = Supervisor(specs, sink, FAST)

    async def stop_when_both_up(stop: asyncio.Event) -> None:
        await sink.until(lambda: sink.of("a") == ["up"] and sink.of("b") == ["up"])
        sup.request_stop("test done")

    await asyncio.wait_for(sup.run(stop_when_both_up), 60)
    assert sink.of("a")[-1] == "saw peer" and sink.of("b")[-1] == "saw peer"


async def test_a_child_that_never_becomes_ready_fails_startup() -> None:
    async def never() -> bool:
        return False

    sink = Lines()
    spec = ProcessSpec("slow", _py(SLEEPER), ready=never, ready_timeout_s=0.5)
    sup = Supervisor([spec], sink, FAST)
    with pytest.raises(StartupError, match="slow not ready after"):
        await asyncio.wait_for(sup.run(), 30)
    assert not _alive(sink.pid("slow"))


async def test_an_ungated_child_that_never_becomes_ready_still_fails_startup() -> None:
    async def never() -> bool:
        return False

    sink = Lines()
    specs = [
        ProcessSpec("slow", _py(SLEEPER), ready=never, ready_timeout_s=0.5, gate_start=False),
        ProcessSpec("next", _py(SLEEPER)),
    ]
    sup = Supervisor(specs, sink, FAST)
    with pytest.raises(StartupError, match="slow not ready after"):
        await asyncio.wait_for(sup.run(), 30)
    assert not sup.started.is_set()
    assert not _alive(sink.pid("slow")) and not _alive(sink.pid("next"))


async def test_a_missing_program_is_a_clear_startup_error() -> None:
    sup = Supervisor([ProcessSpec("ghost", ("/nonexistent/program",))], Lines(), FAST)
    with pytest.raises(StartupError, match="cannot start ghost"):
        await asyncio.wait_for(sup.run(), 30)


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor([ProcessSpec("a", ("x",)), ProcessSpec("a", ("y",))], Lines())
