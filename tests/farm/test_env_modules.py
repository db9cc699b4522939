"""`farm up --env-modules M`: a plug-in environment reaches the learner and the workers.

The environment is GEM-shaped (plain `reset`/`step`, no base class) and lives in a
module outside the repository, written to tmp_path and put on PYTHONPATH. The learner
checks its dataset against its own registry at start-up, so it stops with "unknown
environment" unless the farm passes the module to it as well as to the workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from farm.config import load_config
from farm.demo import learner_history
from farm.stack import build_stack

PLUGIN = '''
"""A GEM-style environment from outside the repository."""

import envs


class OneWord:
    """Say anything: reward 1 for a non-empty answer."""

    def reset(self, seed=None):
        return "Say one word.", {}

    def step(self, action):
        return "", float(bool(str(action).strip())), True, False, {}


envs.register("gemplug", OneWord)
'''


def _values(argv: tuple[str, ...], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]


def test_env_modules_reach_the_learner_and_every_worker(tmp_path: Path) -> None:
    cfg = load_config(None, work_dir=tmp_path, workers=2, env_modules="plug_a,plug_b")
    stack = build_stack(cfg, tmp_path / "model", tmp_path / "tasks.jsonl")
    children = [s for s in stack.specs if s.name == "learner" or s.name.startswith("worker")]
    assert len(children) == 3
    assert [_values(s.argv, "--env-modules") for s in children] == [["plug_a,plug_b"]] * 3


@pytest.mark.slow
def test_farm_up_trains_a_plugin_environment(tmp_path: Path, tiny_model: Path) -> None:
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "gemplug_env.py").write_text(PLUGIN)
    out = tmp_path / "farm"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), os.getcwd()])}
    argv = [
        sys.executable,
        "-m",
        "farm",
        "up",
        "--work-dir",
        str(out),
        "--workers",
        "1",
        "--max-steps",
        "2",
        "--metrics-port",
        "0",
        "--model",
        str(tiny_model),
        "--sandbox-backend",
        "bwrap",
        "--env-spec",
        "gemplug@{}",
        "--env-modules",
        "gemplug_env",
        "--learner-arg=--group-size=2",
        "--learner-arg=--groups-per-batch=2",
        "--worker-arg=--max-tokens=2",
        "--quiet",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=280, env=env)
    logs = out / "logs"
    learner_log = (logs / "learner.log").read_text() if (logs / "learner.log").is_file() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:] + learner_log
    assert "farm stopped (learner finished)" in result.stdout
    history = learner_history(logs / "learner.log")
    # both steps trained on episodes the worker ran in the plug-in (reward 1 per non-empty answer)
    assert [step for step, _, _ in history] == [1, 2]
    assert all(0.0 < reward <= 1.0 for _, reward, _ in history), history
