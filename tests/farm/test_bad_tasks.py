"""`farm up` and `farm demo` with a task spec that cannot work (the `env` kwarg of
codegym forgotten): the learner refuses the dataset before issuing a task, and the farm
stops at once, prints the learner's line (dataset line, problem, accepted kwargs) and
exits non-zero, instead of restarting the learner or training on failures.

The farm uses a policy server already running (`--inference-urls`) rather than starting
its own: the learner refuses the dataset before it talks to one, and starting the farm's
own server (a torch import and a model load) is covered by test_up and test_demo.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.workers.conftest import Proc


@pytest.mark.slow
@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_bad_env_spec_stops_the_farm_with_the_learners_line(
    command: str, tmp_path: Path, tiny_model: Path, policy_server: Proc
) -> None:
    work = tmp_path / "farm"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "farm",
            command,
            "--work-dir",
            str(work),
            "--workers",
            "1",
            "--env-spec",
            "codegym",
            "--metrics-port",
            "0",
            "--model",
            str(tiny_model),
            "--inference-urls",
            policy_server.url,
            *(["--time-limit-s", "200"] if command == "demo" else ["--quiet"]),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    farm_errors = [line for line in result.stderr.splitlines() if line.startswith("farm: ")]
    assert len(farm_errors) == 1, result.stderr[-3000:]
    line = farm_errors[0]
    assert "learner exited with status 2 (not restarted)" in line
    assert f"{work.resolve() / 'tasks.jsonl'}:1: bad env_spec 'codegym'" in line
    assert "missing a required argument: 'env'" in line
    assert "accepted kwargs: env (required), config_index" in line
    assert (
        "learner started" in result.stdout and "learner exited with status 2;" not in result.stdout
    )
