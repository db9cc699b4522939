"""launch.runner in a real process: config log masked, signals stop, a dead component fails."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.launch.role", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_sets_the_stop_event_and_exits_0(sig: signal.Signals) -> None:
    proc = _spawn("--token", "tok-secret", "--redis-url", "redis://u:pw-secret@h:1/0")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "stopping"
    [line] = [x for x in err.splitlines() if '"event": "config"' in x]
    logged = json.loads(line.split(" probe ", 1)[1])
    assert logged["redis_url"] == "redis://u:***@h:1/0"
    assert "secret" not in err


def test_sigusr1_dumps_every_threads_stack_and_every_task_and_the_role_goes_on() -> None:
    proc = _spawn()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        for _ in range(2):  # still alive after the first dump: it answers again
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "stopping", err
    # The main thread is waiting in the event loop: its stack names the selector.
    assert err.count("Current thread") == 2 and "in select" in err, err
    # ...and the tasks say on what: the role's main task awaits the stop event in _main.
    assert err.count("asyncio: ") == 2, err
    assert "name='probe-main'" in err and "in _main" in err, err


AFTER_THE_LOOP = """
import dataclasses, os, signal, time
import tests.launch.role as r
from launch.runner import start

async def done(ctx):
    return 0

role = dataclasses.replace(r.ROLE, main=done)
for i in range(2):  # a role started twice in one process, as the CLI tests do
    assert start(role, []) == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.3)
    print("alive", i, flush=True)
"""


def test_sigusr1_after_the_roles_loop_closed_still_dumps_and_does_not_kill() -> None:
    """Closing the loop resets its SIGUSR1 handler to the default (terminate): the runner
    puts the threads' dump back first."""
    done = subprocess.run(
        [sys.executable, "-c", AFTER_THE_LOOP], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["alive", "0", "alive", "1"]
    assert done.stderr.count("Current thread") == 2


def test_a_failed_component_ends_the_role_with_status_1() -> None:
    proc = _spawn("--fail")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "RuntimeError: component broke" in err


def test_a_bad_config_exits_2_listing_the_problem() -> None:
    proc = _spawn("--log-level", "LOUD")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "error: invalid probe configuration:" in err and "log_level" in err
