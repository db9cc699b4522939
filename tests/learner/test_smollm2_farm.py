"""SmolLM2-135M-Instruct trained through the whole farm: redis-server, the CPU policy server,
a `python -m workers` process and `python -m learner`, on the `arith` environment.

A few steps, not a learning claim (that is the in-process measurement in BENCHMARKS.md): every
loss is finite and some gradient is not zero, the last pushed version differs from the base
weights, the server serves it, and a fresh server started from the pushed directory samples what the trained
server samples (same greedy tokens and logprobs), which the base model does not.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from inference.client import ClientConfig, GenerationClient, SamplingParams
from tests.conftest import RedisServer
from tests.learner.farm import farm, step_records
from workers.tokens import load_codec

STEPS, GROUPS, GROUP_SIZE, MAX_TOKENS = 3, 2, 4, 12
PROBE = "What is 4+3? Answer with the number only."


def _changed_tensors(base: Path, pushed: Path) -> int:
    """Tensors of `pushed` that differ from `base`'s, over the keys both hold."""
    changed = 0
    with safe_open(base, "pt") as a, safe_open(pushed, "pt") as b:
        for key in set(a.keys()) & set(b.keys()):
            changed += int(not a.get_tensor(key).equal(b.get_tensor(key)))
    return changed


async def _greedy(url: str, model: Path) -> tuple[list[int], list[float], list[int]]:
    codec = load_codec(str(model))
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=codec.stop_token_ids)
    async with GenerationClient([url], ClientConfig()) as client:
        gen = await client.generate(codec.initial_prompt(PROBE, None, None), params, session_id="p")
    return gen.token_ids, gen.logprobs, gen.weight_versions


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_trains_through_the_farm_and_the_pushed_weights_load_back(
    redis_server: RedisServer, smollm2_dir: Path, tmp_path: Path
) -> None:
    logs, weights = tmp_path / "logs", tmp_path / "weights"
    logs.mkdir()
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps({"env_spec": "arith"}) + "\n")
    with farm(logs) as f:
        url = f.server("server", smollm2_dir)
        base = asyncio.run(_greedy(url, smollm2_dir))
        f.worker(
            "worker",
            redis_server.url,
            "smol",
            url,
            smollm2_dir,
            concurrency=16,
            max_tokens=MAX_TOKENS,
        )
        learner = f.spawn(
            "learner",
            [
                "learner",
                "--run",
                "smol",
                "--redis-url",
                redis_server.url,
                "--inference-urls",
                url,
                "--model",
                str(smollm2_dir),
                "--tasks",
                str(tasks),
                "--group-size",
                str(GROUP_SIZE),
                "--groups-per-batch",
                str(GROUPS),
                "--max-staleness",
                "0",
                "--learning-rate",
                "2e-5",
                "--micro-batch-size",
                "8",
                "--max-steps",
                str(STEPS),
                "--push-interval",
                "1",
                "--weights-dir",
                str(weights),
            ],
        )
        assert learner.wait(600) == 0, f.log("learner")[-3000:]
        records = step_records(f.log("learner"))
        trained = asyncio.run(_greedy(url, smollm2_dir))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # a batch whose groups all scored alike trains nothing and logs no loss; the rest must
    losses = [float(r["loss"]) for r in records if "loss" in r]  # type: ignore[arg-type]
    assert losses and all(math.isfinite(x) for x in losses), records
    assert any(float(r.get("grad_norm", 0.0)) > 0 for r in records), records  # type: ignore[arg-type]
    pushed = sorted(weights.glob("v*"))
    assert pushed and pushed[-1].name == f"v{STEPS:08d}", pushed
    assert _changed_tensors(smollm2_dir / "model.safetensors", pushed[-1] / "model.safetensors")
    assert set(base[2]) == {0} and set(trained[2]) == {STEPS}  # the served weight version

    with farm(tmp_path) as g:  # the last push, loaded by a fresh server
        reloaded = asyncio.run(_greedy(g.server("reloaded", pushed[-1]), pushed[-1]))
    assert reloaded[0] == trained[0]
    assert reloaded[1] == pytest.approx(trained[1], abs=1e-4)
    assert base[:2] != trained[:2], "three steps at 2e-5 left the greedy logprobs unchanged"
