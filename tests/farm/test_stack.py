"""Which processes `farm up` runs, with which flags, depending on what is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.config import load_config
from farm.errors import StartupError
from farm.stack import build_stack, prepare


def _flag(argv: tuple[str, ...], name: str) -> str:
    """The value of flag `name`, given as `--name value` or `--name=value`."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise ValueError(f"{name} not in {argv}")


def test_local_stack_starts_redis_and_the_policy_server_first(tmp_path: Path) -> None:
    cfg = load_config(None, work_dir=tmp_path, workers=2, max_steps=5, redis_port=6390)
    stack = build_stack(cfg, tmp_path / "model", tmp_path / "tasks.jsonl")
    assert [s.name for s in stack.specs] == [
        "redis",
        "inference",
        "learner",
        "worker-0",
        "worker-1",
    ]
    redis = stack.specs[0].argv
    assert _flag(redis, "--appendonly") == "yes"
    assert _flag(redis, "--dir") == str(tmp_path.resolve() / "redis")
    assert _flag(redis, "--bind") == "127.0.0.1"
    assert stack.redis_url == "redis://127.0.0.1:6390/0"
    # the learner and workers start while the CPU server loads (workers wait for its /health)
    assert [s.gate_start for s in stack.specs] == [True, False, True, True, True]
    assert [s.start_group for s in stack.specs[3:]] == ["workers", "workers"]  # stop together
    learner = stack.specs[2]
    assert learner.finishes_stack and _flag(learner.argv, "--max-steps") == "5"
    assert "--resume" in learner.argv
    for spec in stack.specs[2:]:
        assert _flag(spec.argv, "--redis-url") == stack.redis_url
        assert _flag(spec.argv, "--inference-urls") == stack.inference_urls[0]
    ids = [_flag(s.argv, "--worker-id") for s in stack.specs[3:]]
    assert ids == ["farm-worker-0", "farm-worker-1"]
    assert len(set(stack.metrics_urls.values())) == 4  # inference, learner, two workers


def test_given_redis_and_servers_are_used_not_started(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        work_dir=tmp_path,
        workers=1,
        redis_url="redis://10.0.0.1:6379/2",
        inference_urls="http://a:8000,http://b:8000",
        learner_args=["--learning-rate", "1e-4"],
    )
    stack = build_stack(cfg, tmp_path / "model", tmp_path / "tasks.jsonl")
    assert [s.name for s in stack.specs] == ["learner", "worker-0"]
    learner = stack.specs[0].argv
    assert _flag(learner, "--inference-urls") == "http://a:8000,http://b:8000"
    assert _flag(learner, "--redis-url") == "redis://10.0.0.1:6379/2"
    assert learner[-2:] == ("--learning-rate", "1e-4")
    assert not stack.specs[0].finishes_stack  # no --max-steps: the farm runs until stopped
    assert "--partitions" not in learner  # one partition: the roles' own default


def test_partitions_reach_the_learner_and_every_worker(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        work_dir=tmp_path,
        workers=2,
        partitions=3,
        redis_url="redis+cluster://10.0.0.1:7000/0",
    )
    stack = build_stack(cfg, tmp_path / "model", tmp_path / "tasks.jsonl")
    assert [s.name for s in stack.specs] == ["inference", "learner", "worker-0", "worker-1"]
    assert [_flag(s.argv, "--partitions") for s in stack.specs[1:]] == ["3", "3", "3"]


async def test_prepare_writes_the_task_file_and_rejects_missing_inputs(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(
        None, work_dir=tmp_path / "run", model=model, env_spec='toy@{"difficulty": 2}'
    )
    _, tasks = await prepare(cfg, lambda name, line: None)
    assert tasks.read_text() == '{"env_spec": "toy@{\\"difficulty\\": 2}"}\n'
    with pytest.raises(StartupError, match="does not exist"):
        await prepare(
            load_config(None, work_dir=tmp_path, model=model, tasks=tmp_path / "no.jsonl"),
            lambda name, line: None,
        )
    with pytest.raises(StartupError, match="no model"):
        await prepare(
            load_config(None, work_dir=tmp_path, model=tmp_path / "empty"), lambda name, line: None
        )
