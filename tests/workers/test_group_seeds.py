"""A group is n samples of one prompt: one reset seed for the group, a sampling seed per episode.

Runs real groups through the worker's group runner against a real CPU policy server (the
tiny model): every episode of a `toy` group starts from the same prompt tokens (before the
fix, episode i reset with `task.seed + i` and saw a different digit), the episodes' draws
differ (each has its own sampling seed), a re-run of the task draws exactly the same tokens
(the seeds are the task's, not the server's randomness), and an agent gets the task's seed.
"""

from __future__ import annotations

import json
from pathlib import Path

from broker.messages import Sampling, Task, TrajectoryGroup
from inference.client import ClientConfig, GenerationClient, SamplingParams
from tests.workers.agent_helpers import serving
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group
from workers.tokens import load_codec

CFG = EpisodeSettings(max_tokens=1, temperature=1.0)


async def _toy_group(tiny_model_dir: Path, url: str, task: Task) -> TrajectoryGroup:
    codec = load_codec(str(tiny_model_dir))
    async with GenerationClient([url], ClientConfig(request_timeout_s=30)) as client:
        ctx = EpisodeContext(codec=codec, client=client, sampling=SamplingParams)
        return await run_group(ctx, CFG, task, max_turns=1, retries=0, worker_id="w")


async def test_a_groups_episodes_share_the_prompt_and_not_the_draws(
    tiny_model_dir: Path, policy_server
) -> None:
    task = Task("seeds", 'toy@{"difficulty": 1}', group_size=16, seed=7, policy_version=0)
    group = await _toy_group(tiny_model_dir, policy_server.url, task)
    prompts = {t.turns[0].prompt_ids.tobytes() for t in group.trajectories}
    assert len(prompts) == 1, "the episodes of one group saw different prompts"
    answers = [int(t.turns[0].completion_ids[0]) for t in group.trajectories]
    assert len(set(answers)) > 1, "every episode drew the same token: one sampling seed"
    # The turn records what the tokens were drawn from: the digits only, at temperature 1.
    codec = load_codec(str(tiny_model_dir))
    digits = codec.allowed_token_ids(tuple(str(d) for d in range(10)))
    want = Sampling(1.0, allowed_token_ids=digits)
    assert all(t.turns[0].sampling == want for t in group.trajectories)
    again = await _toy_group(tiny_model_dir, policy_server.url, task)
    assert [int(t.turns[0].completion_ids[0]) for t in again.trajectories] == answers
    other = Task("seeds-2", 'toy@{"difficulty": 1}', group_size=16, seed=8, policy_version=0)
    moved = await _toy_group(tiny_model_dir, policy_server.url, other)
    assert moved.trajectories[0].turns[0].prompt_ids.tobytes() not in prompts


async def test_an_agent_gets_the_tasks_seed_and_its_calls_differ(tiny_model_dir: Path) -> None:
    body = json.dumps({"entry": "tests.workers.agents:chatty", "task": {"calls": 2, "reward": 1}})
    task = Task("agent-seeds", f"agent@{body}", group_size=6, seed=11, policy_version=0)
    cfg = EpisodeSettings(max_tokens=3)
    async with serving(tiny_model_dir) as endpoint:
        ctx = EpisodeContext(endpoint.codec, endpoint.client, SamplingParams, agents=endpoint)
        group = await run_group(ctx, cfg, task, max_turns=8, retries=0, worker_id="w")
    # `chatty` passes api.seed on every call: the endpoint still gives each episode its draws.
    firsts = {t.turns[0].completion_ids.tobytes() for t in group.trajectories}
    assert len(firsts) > 1, "the group's agent episodes drew identical completions"
    assert {t.timings["agent/seed"] for t in group.trajectories} == {11.0}


async def test_each_turn_samples_and_records_the_actions_the_env_allows_then(
    tiny_model_dir: Path, policy_server
) -> None:
    # lookup's protocol: the call '?' alone on turn 1, the digits on the answer turn. Before the
    # worker read the vocabulary per turn, turn 1 drew digits too, a distractor in the context.
    codec = load_codec(str(tiny_model_dir))
    task = Task("phases", "lookup", group_size=16, seed=3, policy_version=0)
    async with GenerationClient([policy_server.url], ClientConfig(request_timeout_s=30)) as client:
        ctx = EpisodeContext(codec=codec, client=client, sampling=SamplingParams)
        group = await run_group(ctx, CFG, task, max_turns=2, retries=0, worker_id="w")
    call = Sampling(1.0, allowed_token_ids=codec.allowed_token_ids(("?",)))
    answer = Sampling(1.0, allowed_token_ids=codec.allowed_token_ids(tuple("0123456789")))
    for trajectory in group.trajectories:
        first, second = trajectory.turns
        assert (first.sampling, second.sampling) == (call, answer)
        first.sampling.check_drawn(first.completion_ids)
        second.sampling.check_drawn(second.completion_ids)
