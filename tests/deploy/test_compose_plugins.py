"""`farm images build --with PATH`: a plug-in environment baked into the worker image runs
under compose.

The plug-in is a small Python project written here (outside the repository, with a
dependency the image lacks: `inflection`, fetched from the package index the host reaches).
`build(plugins=[project])` adds it to the worker image as one more layer; compose's CPU
profile then runs from that image with nothing mounted: tasks name the plug-in's
environment, workers and learner import its module (FARM_ENV_MODULES), and the learner
trains two steps on groups the worker rolled out in it and exits 0. Without the plug-in
in the image the learner refuses the dataset ("unknown environment") and the workers could
not run a task.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port, require
from tests.deploy.compose import COMPOSE, Stack, compose_cli, states

pytestmark = [pytest.mark.slow, pytest.mark.docker]

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "farm-plugin-word"
version = "0.1.0"
dependencies = ["inflection>=0.5"]

[tool.setuptools]
py-modules = ["wordenv"]
"""

MODULE = '''
"""A plug-in environment: say a word; reward 1 when the answer has a word character."""

import inflection

import envs


class SayWord:
    def reset(self, seed=None):
        return "Say a word.", {}

    def step(self, action):
        word = inflection.underscore(str(action)).strip()
        return "", float(any(c.isalnum() for c in word)), True, False, {}


envs.register("sayword", SayWord)
'''


def _plugin(root: Path) -> Path:
    project = root / "word-plugin"
    project.mkdir()
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "wordenv.py").write_text(MODULE)
    return project


@pytest.mark.timeout(1500)  # the first build of the images (torch's wheel) takes minutes
def test_a_plugin_environment_baked_into_the_image_runs_under_compose(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    info = docker and subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False)
    require(bool(info) and info.returncode == 0, "a Docker engine")
    compose_cli()
    from farm.images import PROMETHEUS, REDIS, WORKER, build

    started = time.monotonic()
    plain = build(quiet=True, env_file=None)
    tags = build(quiet=True, env_file=None, plugins=[_plugin(tmp_path)])
    print(f"images ready in {time.monotonic() - started:.0f} s")
    assert tags[WORKER] != plain[WORKER] and tags[WORKER].startswith("rollout-farm/worker:")
    models, tasks = tmp_path / "models", tmp_path / "tasks"
    for d in (models, tasks):
        d.mkdir()
        d.chmod(0o777)
    (tasks / "tasks.jsonl").write_text(json.dumps({"env_spec": "sayword"}) + "\n")
    run = {"FARM_ENV_MODULES": "wordenv"}
    learner = {**run, "FARM_GROUP_SIZE": "2", "FARM_GROUPS_PER_BATCH": "2", "FARM_MAX_STEPS": "2"}
    override = {
        "services": {
            "worker": {"environment": {**run, "FARM_MAX_TOKENS": "2"}},
            "learner-cpu": {"environment": learner, "volumes": [f"{tasks}:/config:ro"]},
        }
    }
    (tmp_path / "override.yml").write_text(yaml.safe_dump(override))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {
        "FARM_RUN": "plugins",
        "FARM_MODEL_DIR": str(models),
        "FARM_PROMETHEUS_PORT": str(free_port()),
        WORKER.variable: tags[WORKER],
        REDIS.variable: tags[REDIS],
        PROMETHEUS.variable: tags[PROMETHEUS],
    }
    stack = Stack(f"rf-plug-{uuid.uuid4().hex[:8]}", [COMPOSE, tmp_path / "override.yml"], env)
    try:
        stack.run("--profile", "cpu", "up", "-d", "--scale", "worker=1", timeout=300)
        ids = stack.ids("learner-cpu")
        deadline = time.monotonic() + 240
        while not (found := states(ids)) or found[0]["Status"] != "exited":
            assert time.monotonic() < deadline, (
                f"{stack.logs('worker')}\n{stack.stacks('learner-cpu')}"
            )
            time.sleep(2)
        logs = stack.logs("learner-cpu", tail=400)
        assert found[0]["ExitCode"] == 0, logs
        steps = [
            json.loads(line.split(" learner ", 1)[1])
            for line in logs.splitlines()
            if '"event": "step"' in line
        ]
        assert [s["step"] for s in steps] == [1, 2], logs
        assert all(s["reward_mean"] > 0 for s in steps), steps  # the plug-in's rewards
    finally:
        print(stack.logs(tail=25))
        stack.down()
