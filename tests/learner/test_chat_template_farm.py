"""A Qwen3 three-turn tool episode, thinking on and off, trained through the whole farm.

The model is tiny and random, built locally over Qwen3's real tokenizer and chat template
(tests/chat_models); redis-server, the CPU policy server, a `python -m workers` process (with
`--tool-parser hermes --reasoning-parser qwen3 --chat-template-kwargs`) and `python -m
learner` run as in production. Each episode of `wk-toolturns` talks, calls `lookup` (the tool
result comes back as a `tool` message, which Qwen3 writes inside `<tool_response>`), and
answers. A few steps, not a learning claim: the episodes have their three turns and the
reasoning the worker split off, every loss is finite, some gradient is not zero, and the
pushed weights differ from the base ones.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from broker.messages import ErrorCategory, Task
from inference.client import ClientConfig, GenerationClient, SamplingParams
from tests.chat_models import tiny_model_dir
from tests.conftest import RedisServer
from tests.learner.farm import farm, step_records
from tests.workers import chatenvs
from workers.answers import AnswerReader
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec

STEPS, GROUPS, GROUP_SIZE, MAX_TOKENS = 3, 2, 6, 6


assert chatenvs.ToolTurns  # registered in this process too: the probe group runs here


def _spec(thinking: bool) -> str:
    kwargs = {"forced_call": True, "vocabulary": True, "thinking": thinking}
    return "wk-toolturns@" + json.dumps(kwargs)


async def _one_group(url: str, model: Path, thinking: bool) -> list:
    """One group run in-process against the farm's server, as the worker runs it."""
    codec = load_codec(str(model), {"enable_thinking": thinking})
    reader = AnswerReader(codec, "hermes", "qwen3")
    task = Task("probe", _spec(thinking), group_size=4, seed=5, policy_version=0)
    async with GenerationClient([url], ClientConfig(request_timeout_s=60)) as client:
        ctx = EpisodeContext(codec, client, SamplingParams, reader=reader)
        cfg = EpisodeSettings(max_tokens=MAX_TOKENS, max_context_tokens=4096)
        group = await run_group(ctx, cfg, task, max_turns=8, retries=0, worker_id="probe")
    return [codec, list(group.trajectories)]


def _changed_tensors(base: Path, pushed: Path) -> int:
    with safe_open(base, "pt") as a, safe_open(pushed, "pt") as b:
        return sum(
            not a.get_tensor(k).equal(b.get_tensor(k)) for k in set(a.keys()) & set(b.keys())
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_qwen3_tool_episodes_train_through_the_farm(
    redis_server: RedisServer, tmp_path: Path, thinking: bool
) -> None:
    model = tiny_model_dir("qwen3")
    logs, weights = tmp_path / "logs", tmp_path / "weights"
    logs.mkdir()
    (tasks := tmp_path / "tasks.jsonl").write_text(json.dumps({"env_spec": _spec(thinking)}) + "\n")
    chat = [
        "--env-modules",
        "tests.workers.chatenvs",
        "--tool-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template-kwargs",
        json.dumps({"enable_thinking": thinking}),
    ]
    with farm(logs) as f:
        url = f.server("server", model)
        codec, probe = asyncio.run(_one_group(url, model, thinking))
        f.worker(
            "worker",
            redis_server.url,
            "q3",
            url,
            model,
            concurrency=12,
            max_tokens=MAX_TOKENS,
            extra=tuple(chat),
        )
        learner = f.spawn(
            "learner",
            [
                "learner",
                "--run",
                "q3",
                "--redis-url",
                redis_server.url,
                "--inference-urls",
                url,
                "--model",
                str(model),
                "--tasks",
                str(tasks),
                "--env-modules",
                "tests.workers.chatenvs",
                "--group-size",
                str(GROUP_SIZE),
                "--groups-per-batch",
                str(GROUPS),
                "--max-staleness",
                "0",
                "--learning-rate",
                "1e-2",
                "--micro-batch-size",
                "12",
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
    # the episodes as the worker runs them: three turns, the tool's result in Qwen3's markers,
    # the reasoning split off (thinking) or none (no thinking: the template closed it)
    for traj in probe:
        assert traj.error is ErrorCategory.NONE and len(traj.turns) == 3, traj.error_detail
        result = codec.decode(traj.turns[2].prompt_ids, skip_special=False)
        assert "<tool_response>" in result and "</tool_response>" in result
        talked, answered = traj.turns[0], traj.turns[2]
        if thinking:
            assert talked.reasoning_tokens > 0 and answered.reasoning_tokens > 0
        else:
            assert all(t.reasoning_tokens == 0 for t in traj.turns)
            assert codec.decode(talked.prompt_ids, skip_special=False).endswith(
                "<think>\n\n</think>\n\n"
            )
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    losses = [float(r["loss"]) for r in records if "loss" in r]  # type: ignore[arg-type]
    assert losses and all(math.isfinite(x) for x in losses), records
    assert any(float(r.get("grad_norm", 0.0)) > 0 for r in records), records  # type: ignore[arg-type]
    pushed = sorted(weights.glob("v*"))
    assert pushed and _changed_tensors(
        model / "model.safetensors", pushed[-1] / "model.safetensors"
    )
