"""Stopping a role process while it imports: an env module whose import takes minutes stands
in for a heavy import (`--env-modules`, imported during start-up by the workers and the
learner), and announces itself with a file."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# An env module whose import takes minutes: the stand-in for a heavy import, announced by a file.
SLOW_MODULE = """
import pathlib, time
pathlib.Path(__file__).with_name("importing").touch()
time.sleep(120)
"""


def _slow_env_module(tmp_path: Path) -> dict[str, str]:
    """Write the slow module; the environment that lets a child import it."""
    (tmp_path / "slow_env_module.py").write_text(SLOW_MODULE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def stop_while_importing(argv: list[str], tmp_path: Path) -> int:
    """Start `argv` (importing the slow module), SIGTERM it mid-import; its exit status."""
    env = _slow_env_module(tmp_path)
    log = tmp_path / "output.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "importing").exists():
            assert proc.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the process never reached the slow import"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        # the import sleeps 120 s: a process that finishes starting first is not back within 20
        return proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
