"""The loop closes: real redis-server, CPU policy server with the tiny model, a real
worker process, the learner and the toy environment. With weight push the mean reward
of the last window rises clearly above the first; the control run, identical but with
weight push turned off, shows no such rise (the servers keep sampling the initial
weights, so learning on the learner's side alone cannot move the reward)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tests.learner.farm import farm, step_records, toy_tasks

# On-policy (max_staleness 0) so that every step's gradient is unclipped; lr and batch
# tuned so that the toy task (copy a digit, ~10% by chance) rises within ~25 steps.
STEPS, CONTROL_STEPS, WINDOW, RISE, LR = 24, 12, 6, 0.1, "1e-2"


def run_farm(
    redis_url: str, run: str, model: Path, logs: Path, push_interval: int, steps: int
) -> list[float]:
    logs.mkdir()
    with farm(logs) as f:
        url = f.server("server", model)
        f.worker("worker", redis_url, run, url, model, concurrency=128)
        learner = f.spawn("learner", [
            "learner", "--redis-url", redis_url, "--run", run, "--inference-urls", url,
            "--model", str(model), "--tasks", str(toy_tasks(logs / "tasks.jsonl")),
            "--group-size", "8", "--groups-per-batch", "8", "--max-staleness", "0",
            "--learning-rate", LR, "--micro-batch-size", "64", "--max-steps", str(steps),
            "--push-interval", str(push_interval), "--weights-dir", str(logs / "weights"),
        ])  # fmt: skip
        assert learner.wait(240) == 0, f.log("learner")[-3000:]
        records = step_records(f.log("learner"))
    assert len(records) == steps
    return [float(r["reward_mean"]) for r in records]  # type: ignore[arg-type]


def rise(rewards: list[float]) -> float:
    return statistics.mean(rewards[-WINDOW:]) - statistics.mean(rewards[:WINDOW])


@pytest.mark.slow
def test_reward_rises_with_weight_push_and_not_without(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    learning = run_farm(redis_server.url, "learn", tiny_model_dir, tmp_path / "learn", 1, STEPS)
    assert rise(learning) >= RISE, f"no learning: {learning}"
    control = run_farm(
        redis_server.url, "control", tiny_model_dir, tmp_path / "control", 0, CONTROL_STEPS
    )
    assert rise(control) < RISE, f"reward rose without weight push: {control}"
