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
