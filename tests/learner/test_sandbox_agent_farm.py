"""A black-box agent program in the sandbox, trained through the whole farm.

redis-server, the CPU policy server, a `python -m workers` process with a bubblewrap sandbox
pool and `python -m learner` run as in production. Each episode runs the stdlib example agent
(examples/sandbox_shell_agent.py) inside its own sandbox session: it reaches the worker's
endpoint only through the session's bridge, and the task's check scores what it left in
the work dir (here the parity of its last reply's length: a reward that varies between
the episodes of a group, so the groups carry a gradient). A few steps, not a learning
claim: every step trains on agent groups, some gradient is not zero, and the pushed
weights differ from the base ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import RedisServer
from tests.learner.farm import ROOT, farm, step_records
from tests.sandbox.conftest import require_backend

STEPS, GROUPS, GROUP_SIZE = 2, 2, 4
SPEC = {
    "command": ["python3", "agent.py"],
    "files": {"agent.py": str(ROOT / "examples" / "sandbox_shell_agent.py")},
    "task": {
        "name": "even-reply",
        "prompt": "Reply with a word.",
        "check": "test $(( $(wc -c < answer.txt) % 2 )) -eq 0",
    },
    "max_calls": 4,
}


def _changed_tensors(base: Path, pushed: Path) -> int:
    with safe_open(base, "pt") as a, safe_open(pushed, "pt") as b:
        return sum(
            not a.get_tensor(k).equal(b.get_tensor(k)) for k in set(a.keys()) & set(b.keys())
        )


@pytest.mark.slow
@pytest.mark.bwrap
@pytest.mark.timeout(900)
def test_a_sandboxed_agent_program_trains_through_the_farm(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    require_backend("bwrap")
    logs, weights = tmp_path / "logs", tmp_path / "weights"
    logs.mkdir()
    (tasks := tmp_path / "tasks.jsonl").write_text(
        json.dumps({"env_spec": f"agent@{json.dumps(SPEC)}"}) + "\n"
    )
    with farm(logs) as f:
        url = f.server("server", tiny_model_dir)
        f.worker(
            "worker",
            redis_server.url,
            "sbx",
            url,
            tiny_model_dir,
            concurrency=4,
            max_tokens=16,
            extra=("--sandbox-backend", "bwrap"),
        )
        learner = f.spawn(
            "learner",
            [
                "learner",
                "--run",
                "sbx",
                "--redis-url",
                redis_server.url,
                "--inference-urls",
                url,
                "--model",
                str(tiny_model_dir),
                "--tasks",
                str(tasks),
                "--group-size",
                str(GROUP_SIZE),
                "--groups-per-batch",
                str(GROUPS),
                "--max-staleness",
                "0",
                "--learning-rate",
                "1e-2",
                "--max-steps",
                str(STEPS),
                "--push-interval",
                "1",
                "--weights-dir",
                str(weights),
            ],
        )
        assert learner.wait(600) == 0, f.log("learner")[-3000:] + f.log("worker")[-3000:]
        records = step_records(f.log("learner"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert all(r["trained_groups"] == GROUPS and r["infra_failed"] == 0 for r in records), records
    losses = [float(r["loss"]) for r in records if "loss" in r]  # type: ignore[arg-type]
    assert losses and all(math.isfinite(x) for x in losses), records
    assert any(float(r.get("grad_norm", 0.0)) > 0 for r in records), records  # type: ignore[arg-type]
    pushed = sorted(weights.glob("v*"))
    assert pushed and _changed_tensors(
        tiny_model_dir / "model.safetensors", pushed[-1] / "model.safetensors"
    )
