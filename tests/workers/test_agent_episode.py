"""Agent episodes end to end: the `agent` env kind run by the worker's group runner against the
endpoint and a real CPU policy server; outcomes, error categories, segments in the learner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import envs
from broker.codec import decode, encode
from broker.messages import ErrorCategory, FinishReason, Task, TrajectoryGroup, Truncation
from inference.client import SamplingParams
from learner.batch import prepare_batch
from learner.config import BatchRules
from tests.conftest import free_port
from tests.workers.agent_helpers import serving
from workers.agent_endpoint import AgentEndpoint
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group

CFG = EpisodeSettings(max_tokens=8, episode_timeout_s=60)


def _task(entry: str, n: int = 2, **spec: object) -> Task:
    body = json.dumps({"entry": f"tests.workers.agents:{entry}", **spec})
    return Task(
        task_id=f"t-{entry}", env_spec=f"agent@{body}", group_size=n, seed=5, policy_version=3
    )


async def _group(endpoint: AgentEndpoint, task: Task) -> TrajectoryGroup:
    ctx = EpisodeContext(endpoint.codec, endpoint.client, SamplingParams, agents=endpoint)
    return await run_group(ctx, CFG, task, max_turns=8, retries=0, worker_id="w")


async def test_agent_episodes_record_turns_reward_and_metrics(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        group = await _group(endpoint, _task("chatty", task={"calls": 3, "reward": 0.75}))
    assert len(group.trajectories) == 2 and not group.infra_failed
    for k, traj in enumerate(group.trajectories):
        assert traj.sample_index == k and traj.finish_reason is FinishReason.TERMINATED
        assert [t.reward for t in traj.turns] == [0.0, 0.0, 0.75]
        assert traj.turns[-1].terminated and traj.timings["agent/calls"] == 3.0
        assert all(0 < len(t.completion_ids) <= 3 for t in traj.turns)
    assert endpoint._episodes == {}  # every key expired with its episode


async def test_segments_survive_the_wire_and_train_as_separate_sequences(
    tiny_model_dir: Path,
) -> None:
    async with serving(tiny_model_dir) as endpoint:
        sent = await _group(endpoint, _task("forgetful", n=2))
    group = decode(encode(sent), TrajectoryGroup)
    assert group == sent
    traj = group.trajectories[0]
    assert [t.segment_start for t in traj.turns] == [False, True, True]
    assert traj.timings["segments"] == 3.0
    batch = prepare_batch([group], BatchRules(skip_zero_variance=False), version=3)
    assert len(batch.samples) == 6  # 2 episodes x 3 segments, none glued to another
    for sample, turn in zip(batch.samples[:3], traj.turns, strict=True):
        expected = np.concatenate([turn.prompt_ids, turn.completion_ids])
        assert np.array_equal(sample.input_ids, expected)
        assert sample.loss_mask.sum() == len(turn.completion_ids)


async def test_a_limit_truncates_even_when_the_agent_goes_on(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        group = await _group(endpoint, _task("greedy", n=1, max_calls=2))
    [traj] = group.trajectories
    assert traj.finish_reason is FinishReason.TRUNCATED and traj.truncation is Truncation.MAX_TURNS
    assert len(traj.turns) == 2 and traj.turns[-1].truncated and traj.turns[-1].reward == 0.5


@pytest.mark.parametrize("entry", ["crashes", "says_yes"])
async def test_a_broken_agent_is_category_env(tiny_model_dir: Path, entry: str) -> None:
    async with serving(tiny_model_dir) as endpoint:
        group = await _group(endpoint, _task(entry, n=1))
    [traj] = group.trajectories
    assert traj.finish_reason is FinishReason.ERROR and traj.error is ErrorCategory.ENV
    assert group.infra_failed  # never counted as the model's failure
    assert endpoint._episodes == {}


async def test_inference_failure_is_category_inference(tiny_model_dir: Path) -> None:
    dead = [f"http://127.0.0.1:{free_port()}"]  # a real closed port: connection refused
    async with serving(tiny_model_dir, urls=dead, retry_budget_s=1) as endpoint:
        group = await _group(endpoint, _task("chatty", n=1, task={"calls": 2, "reward": 1.0}))
    [traj] = group.trajectories
    assert traj.error is ErrorCategory.INFERENCE and traj.turns == ()
    assert "retry budget" in traj.error_detail


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"entry": "tests.workers.agents:not_async"}, "must be an async function"),
        ({"entry": "tests.workers.agents:missing"}, "has no 'missing'"),
        ({"entry": "no_such_module:f"}, "cannot import"),
        ({"entry": "tests.workers.agents"}, "pkg.module:function"),
        ({"entry": "tests.workers.agents:chatty", "max_calls": 0}, "max_calls"),
        ({"entry": "tests.workers.agents:chatty", "sandbox": True}, "sandbox"),
    ],
)
def test_bad_agent_specs_are_spec_errors(spec: dict[str, object], problem: str) -> None:
    with pytest.raises(envs.EnvSpecError, match=problem):
        envs.make(f"agent@{json.dumps(spec)}")


@pytest.mark.slow
async def test_a_worker_process_runs_agent_tasks(
    redis_server, policy_server, worker_factory
) -> None:
    """`python -m workers` serves its endpoint and publishes agent groups; a bad entry is
    dead-lettered, not run."""
    from broker.keys import RunKeys
    from tests.workers.farm import groups, publish_tasks, redis_client, wait_groups

    keys = RunKeys("agents")
    good = _task("chatty", n=2, task={"calls": 2, "reward": 1.0})
    bad = Task("t-bad", 'agent@{"entry": "tests.workers.agents:not_async"}', 1, 0, 0)
    async with redis_client(redis_server.url) as redis:
        await publish_tasks(redis, keys, [bad, good])
        worker = worker_factory(redis_server.url, "agents", [policy_server.url])
        [group] = await wait_groups(redis, keys, 1, within_s=90)
        assert group.group_id == good.task_id and not group.infra_failed, worker.output()[-2000:]
        assert [len(t.turns) for t in group.trajectories] == [2, 2]
        assert all(t.turns[-1].reward == 1.0 for t in group.trajectories)
        dead = await redis.xrange(keys.deadletter)
        assert len(dead) == 1 and b"must be an async function" in b"".join(dead[0][1].values())
        assert len(await groups(redis, keys)) == 1


def test_turns_from_older_producers_decode_as_one_segment() -> None:
    from broker.codec import _turn_from, _turn_from_v2, _turn_to
    from broker.messages import Turn

    turn = Turn([1, 2], [3], [-0.5], 0, 0.0, False, False, segment_start=True)
    fields = _turn_to(turn)
    assert _turn_from(fields) == turn and _turn_from(fields).segment_start
    assert not _turn_from_v2(fields[:7]).segment_start  # the layout before segments
