"""A task's dataset row reaches its environment at reset, and a reward function that fails is
recorded as the infrastructure's failure.

Real groups through the worker's group runner against the CPU policy server (the tiny model):
the `dataset` env's prompt is the row's column (its text is in the prompt tokens), the reward
function sees each episode's reply and the row, and its named components reach the worker's
``farm_worker_reward_component`` histogram. A reward function that raises leaves every
trajectory with the ``env`` error category: the group is infra-failed, so the learner
skips it (`learner.batch`) instead of training a 0 against the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import envs
from broker.messages import ErrorCategory, FinishReason, Task, TrajectoryGroup
from inference.client import ClientConfig, GenerationClient, SamplingParams
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec

CFG = EpisodeSettings(max_tokens=4, temperature=1.0)
ROW = {"question": "What is 3+4?", "answer": "7", "bonus": True}
FNS = "tests.envs.rewardfns"


def _task(task_id: str, reward: str, row: dict[str, object] | None = ROW) -> Task:
    spec = "dataset@" + json.dumps({"prompt_column": "question", "reward": reward})
    return Task(task_id, spec, group_size=4, seed=5, policy_version=0, row=row)


async def _group(tiny_model_dir: Path, url: str, task: Task) -> TrajectoryGroup:
    codec = load_codec(str(tiny_model_dir))
    async with GenerationClient([url], ClientConfig(request_timeout_s=30)) as client:
        ctx = EpisodeContext(codec=codec, client=client, sampling=SamplingParams)
        return await run_group(ctx, CFG, task, max_turns=1, retries=0, worker_id="w")


def _component(name: str) -> float:
    labels = {"env": "dataset", "component": name}
    return REGISTRY.get_sample_value("farm_worker_reward_component_count", labels) or 0.0


async def test_the_row_is_the_prompt_and_the_reward_sees_it(
    tiny_model_dir: Path, policy_server
) -> None:
    before = _component("length")
    group = await _group(tiny_model_dir, policy_server.url, _task("rows", f"{FNS}:length_parts"))
    codec = load_codec(str(tiny_model_dir))
    for trajectory in group.trajectories:
        assert trajectory.error is ErrorCategory.NONE, trajectory.error_detail
        turn = trajectory.turns[0]
        assert "What is 3+4?" in codec.decode(turn.prompt_ids, skip_special=False)
        reply = codec.decode(turn.completion_ids)
        assert turn.reward == pytest.approx(min(len(reply), 8) / 8 + 1.0)  # length + bonus
    assert _component("length") == before + 4
    assert not group.infra_failed


async def test_a_reward_function_that_raises_is_an_infrastructure_failure(
    tiny_model_dir: Path, policy_server
) -> None:
    group = await _group(tiny_model_dir, policy_server.url, _task("raising", f"{FNS}:raises"))
    assert group.infra_failed
    for trajectory in group.trajectories:
        assert trajectory.finish_reason is FinishReason.ERROR
        assert trajectory.error is ErrorCategory.ENV
        assert "the grader's database is down" in trajectory.error_detail


async def test_a_task_without_its_row_cannot_run(tiny_model_dir: Path, policy_server) -> None:
    with pytest.raises(ExceptionGroup) as caught:  # the worker dead-letters such a task
        await _group(tiny_model_dir, policy_server.url, _task("no-row", "exact", row=None))
    assert caught.group_contains(envs.EnvSpecError, match="row is unusable")
