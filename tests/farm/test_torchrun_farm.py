"""`farm up --learner-gpus 0,1 --learner-device cpu`: the learner as two torchrun ranks through
the farm, FSDP2 over gloo (the GPU launch, on CPU ranks).

* The stack runs two steps and stops with the learner: both ranks logged that they train
  as a world of 2 under FSDP2, and the steps trained groups the worker produced.
* A learner whose ranks refuse their config (exit 2) stops the farm at once with that
  status, as a one-process learner does: torchrun's own exit status would be 1, which
  the supervisor restarts, again and again, until its restart budget is spent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from farm.demo import learner_history

pytestmark = pytest.mark.slow


def farm_up(
    work: Path, model: Path, *extra: str, timeout: float = 280
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "farm", "up", "--work-dir", str(work), "--model", str(model)]
    argv += ["--workers", "1", "--metrics-port", "0", "--quiet"]
    argv += ["--learner-gpus", "0,1", "--learner-device", "cpu", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_two_gloo_ranks_train_through_the_farm(tmp_path: Path, tiny_model: Path) -> None:
    work = tmp_path / "farm"
    result = farm_up(
        work,
        tiny_model,
        "--max-steps",
        "2",
        "--learner-arg=--group-size=4",
        "--learner-arg=--groups-per-batch=2",
        "--worker-arg=--max-tokens=2",
    )
    log = work / "logs" / "learner.log"
    text = log.read_text() if log.is_file() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:] + text[-3000:]
    assert "farm stopped (learner finished)" in result.stdout
    assert "-m farm.torchrun --standalone --nproc-per-node 2 -m learner" in result.stdout
    assert text.count("training on cpu, world 2 (FSDP2)") == 2  # one line per rank
    assert [step for step, _, _ in learner_history(log)] == [1, 2]


def test_a_rank_refusing_its_config_stops_the_farm_at_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    result = farm_up(tmp_path / "farm", tiny_model, "--learner-arg=--group-size=0", timeout=120)
    assert result.returncode == 1
    assert "learner exited with status 2 (not restarted)" in result.stderr
    assert "restart in" not in result.stdout
