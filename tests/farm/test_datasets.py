"""`farm up` on the data users bring: a Parquet file with `--reward math`, and a `datasets`
directory with a reward function of their own (`--reward pkg.module:fn`).

Each run is the real stack (private redis-server, the CPU policy server on the tiny model,
one worker, the learner) for two learner steps; the learner's step log shows what it
trained. The Parquet file is the worked example (`examples.math_dataset`, written by its
script), graded by math-verify: the tiny model scores 0 there, so its groups carry no
signal, but every episode was scored (none failed). The custom reward pays for the
reply's length, which varies, so that run's groups train.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.math_dataset import problems
from tests.learner.datafiles import saved
from tests.learner.farm import ROOT, step_records

pytestmark = pytest.mark.slow

SMALL = [
    "--learner-arg=--groups-per-batch=2",
    "--learner-arg=--group-size=4",
    "--worker-arg=--max-tokens=4",
    "--worker-arg=--temperature=1.0",
]


def _farm_up(work: Path, model: Path, *args: str) -> list[dict[str, object]]:
    argv = [sys.executable, "-m", "farm", "up", "--work-dir", str(work), "--workers", "1"]
    argv += ["--max-steps", "2", "--metrics-port", "0", "--model", str(model), "--quiet"]
    done = subprocess.run(
        [*argv, *SMALL, *args], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    log = (work / "logs" / "learner.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:] + log[-3000:]
    assert "farm stopped (learner finished)" in done.stdout
    steps = step_records(log)
    assert [s["step"] for s in steps] == [1, 2], log[-3000:]
    return steps


def test_farm_up_trains_on_a_parquet_dataset_with_the_math_reward(
    tmp_path: Path, tiny_model: Path
) -> None:
    data = tmp_path / "math.parquet"
    made = subprocess.run(
        [sys.executable, "-m", "examples.math_dataset", str(data), "--rows", "200"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    steps = _farm_up(
        tmp_path / "farm",
        tiny_model,
        *("--tasks", str(data), "--prompt-column", "question", "--answer-column", "answer"),
        *("--reward", "math", "--dataset-cache-dir", str(tmp_path / "cache")),
    )
    assert all(s["groups"] == 2 and s["infra_failed"] == 0 for s in steps), steps


def test_farm_up_trains_on_a_datasets_directory_with_a_custom_reward(
    tmp_path: Path, tiny_model: Path
) -> None:
    directory = saved(tmp_path / "saved", [{**row, "bonus": False} for row in problems(40)])
    steps = _farm_up(
        tmp_path / "farm",
        tiny_model,
        *("--tasks", str(directory), "--prompt-column", "question"),
        *("--reward", "tests.envs.rewardfns:length_parts", "--reward-timeout-s", "10"),
    )
    assert all(s["infra_failed"] == 0 for s in steps), steps
    assert sum(int(s["trained_groups"]) for s in steps) > 0, steps  # type: ignore[call-overload]
    assert all(0.0 < float(s["reward_mean"]) <= 1.0 for s in steps), steps  # type: ignore[arg-type]
