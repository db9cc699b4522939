"""`python -m learner --weight-transfer nccl --weight-transfer-backend gloo`, end to end.

Real processes: redis-server, two CPU policy servers, one worker, the learner. The learner
forms one gloo group with both servers (vLLM 0.33's NCCL-route choreography) and pushes
every step without writing weight files. After two steps both servers report version 2
and generate with exactly the learner's final weights: their logprobs equal a
teacher-forced pass of the checkpoint's export of those weights, and differ from the
initial model's (an entropy bonus moves them whatever the rewards). The published policy
version has no weights path.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import PolicyVersion
from broker.policy import current_policy
from tests.conftest import RedisServer, free_port
from tests.inference.conftest import teacher_forced_logprobs
from tests.inference.test_server import completion, get, post
from tests.learner.farm import farm, step_records, toy_tasks

STEPS = 2


async def served_logprobs(url: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    status, out = await post(
        url + "/v1/completions", completion(prompt, max_tokens=6, ignore_eos=True, seed=3)
    )
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])


@pytest.mark.slow
def test_learner_pushes_over_the_nccl_routes(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run, work = "nccl", tmp_path
    with farm(tmp_path) as f:
        urls = [f.server(f"server-{i}", tiny_model_dir) for i in range(2)]
        f.worker("worker", redis_server.url, run, urls[0], tiny_model_dir, concurrency=16)
        learner = f.spawn(
            "learner",
            [
                "learner",
                "--run",
                run,
                "--redis-url",
                redis_server.url,
                "--model",
                str(tiny_model_dir),
                "--inference-urls",
                ",".join(urls),
                "--tasks",
                str(toy_tasks(work / "tasks.jsonl")),
                "--group-size",
                "4",
                "--groups-per-batch",
                "2",
                "--no-skip-zero-variance",
                "--learning-rate",
                "1e-2",
                "--entropy-coef",
                "0.1",  # moves the weights even if every reward is equal
                "--max-steps",
                str(STEPS),
                "--push-interval",
                "1",
                "--checkpoint-dir",
                str(work / "ckpt"),
                "--weights-dir",
                str(work / "weights"),
                "--weight-transfer",
                "nccl",
                "--weight-transfer-backend",
                "gloo",
                "--weight-transfer-master-port",
                str(free_port()),
            ],
        )
        assert learner.wait(240) == 0, f.log("learner")[-3000:]
        assert len(step_records(f.log("learner"))) == STEPS
        assert not (work / "weights").exists()  # nothing went through files
        final = work / "ckpt" / f"step-{STEPS:08d}"
        prompt = [5, 6, 7]
        for url in urls:
            assert asyncio.run(get(url + "/weight_info"))[1] == f'{{"weight_version": "{STEPS}"}}'
            tokens, served = asyncio.run(served_logprobs(url, prompt))
            pushed = teacher_forced_logprobs(final, prompt, tokens)
            initial = teacher_forced_logprobs(tiny_model_dir, prompt, tokens)
            assert float((served - pushed).abs().max()) < 1e-4
            assert float((served - initial).abs().max()) > 1e-3  # training moved them
    policy = asyncio.run(_policy(redis_server.url, run))
    assert policy is not None and policy.version == STEPS
    assert policy.weights_path == "" and list(policy.servers) == urls


async def _policy(url: str, run: str) -> PolicyVersion | None:
    redis = await connect(RedisSettings.from_url(url))
    try:
        return await current_policy(redis, RunKeys(run))
    finally:
        await redis.aclose()
