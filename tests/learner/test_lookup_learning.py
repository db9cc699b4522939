"""A multi-turn tool task is learned end to end: `lookup` (look the key up, then answer
with the digit the tool returned) on the real stack (redis-server, the CPU policy server
with the tiny model, a worker process, the learner).

Answering without using the tool's observation scores ~8% (ten digits, plus the stop
tokens a worker also allows). With GRPO and weight push the mean reward of the last
window rises well above that; the control, identical but with weight push off, stays at
chance, so the rise comes from the served policy learning, not from the data.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.conftest import RedisServer
from tests.learner.farm import farm, step_records

# On-policy, lr and batch as in test_e2e (tuned for the one-token copy skill); in tuning
# runs the last 10 steps of 60 averaged 0.35-0.6, the first 10 about 0.08.
STEPS, CONTROL_STEPS, WINDOW, ABOVE, LR = 60, 20, 10, 0.25, "5e-3"


def run(redis_url: str, run_name: str, model: Path, logs: Path, *, push: int, steps: int,
        algorithm: str = "grpo") -> list[float]:  # fmt: skip
    logs.mkdir()
    tasks = logs / "tasks.jsonl"
    tasks.write_text(json.dumps({"env_spec": "lookup"}) + "\n")
    with farm(logs) as f:
        url = f.server("server", model)
        f.worker(f"{run_name}-worker", redis_url, run_name, url, model, concurrency=64)
        learner = f.spawn("learner", [
            "learner", "--redis-url", redis_url, "--run", run_name, "--inference-urls", url,
            "--model", str(model), "--tasks", str(tasks), "--algorithm", algorithm,
            "--group-size", "8", "--groups-per-batch", "8", "--max-staleness", "0",
            "--learning-rate", LR, "--micro-batch-size", "64", "--max-steps", str(steps),
            "--push-interval", str(push), "--weights-dir", str(logs / "weights"),
        ])  # fmt: skip
        assert learner.wait(600) == 0, f.log("learner")[-3000:]
        records = step_records(f.log("learner"))
    assert len(records) == steps
    return [float(r["reward_mean"]) for r in records]  # type: ignore[arg-type]


@pytest.mark.slow
def test_grpo_learns_to_answer_from_the_tool_and_the_no_push_control_does_not(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    learned = run(redis_server.url, "lookup", tiny_model_dir, tmp_path / "learn", push=1,
                  steps=STEPS)  # fmt: skip
    assert statistics.mean(learned[-WINDOW:]) >= ABOVE, f"no learning: {learned}"
    control = run(redis_server.url, "lookup-control", tiny_model_dir, tmp_path / "control",
                  push=0, steps=CONTROL_STEPS)  # fmt: skip
    assert statistics.mean(control[-WINDOW:]) < ABOVE / 2, f"rose without push: {control}"
