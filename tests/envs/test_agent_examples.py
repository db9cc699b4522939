"""The agent examples run as real agent episodes: the OpenAI-SDK tool loop on the `code`
problems with a sandboxed `run_python` tool, and the history-editing agent's segments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.messages import FinishReason, Task
from envs.sandboxed import open_session
from examples.code_tool_agent import run_python
from inference.client import SamplingParams
from tests.workers.agent_helpers import serving
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group

CFG = EpisodeSettings(max_tokens=16, episode_timeout_s=120)


def _task(entry: str, n: int, **spec: Any) -> Task:
    body = json.dumps({"entry": entry, **spec})
    return Task(task_id=entry, env_spec=f"agent@{body}", group_size=n, seed=1, policy_version=0)


async def test_run_python_tool_runs_in_the_sandbox(bwrap_pool: Any) -> None:
    async with open_session(bwrap_pool) as sb:
        ran = await run_python(sb, json.dumps({"code": "import sys; print(6 * 7); sys.exit(3)"}))
        refused = await run_python(sb, "not json")
    assert ran.startswith("exit code 3") and "42" in ran
    assert refused.startswith("error:")


async def test_code_tool_agent_runs_as_an_episode(bwrap_pool: Any, tiny_model_dir: Path) -> None:
    task = _task(
        "examples.code_tool_agent:solve",
        1,
        use_sandbox=True,
        task={"problem_id": "sum-two", "max_rounds": 2},
    )
    async with serving(tiny_model_dir) as endpoint:
        ctx = EpisodeContext(endpoint.codec, endpoint.client, SamplingParams, bwrap_pool, endpoint)
        group = await run_group(ctx, CFG, task, max_turns=8, retries=0, worker_id="w")
    [traj] = group.trajectories
    assert traj.finish_reason is FinishReason.TERMINATED, traj.error_detail
    assert 1 <= len(traj.turns) <= 2 and traj.turns[-1].reward in (0.0, 1.0)
    assert "agent/tests_passed" in traj.timings and "agent/tool_calls" in traj.timings


async def test_summarising_agent_makes_a_segment_per_summary(tiny_model_dir: Path) -> None:
    task = _task("examples.summarising_agent:chat", 2, task={"rounds": 6, "keep": 2})
    async with serving(tiny_model_dir) as endpoint:
        ctx = EpisodeContext(endpoint.codec, endpoint.client, SamplingParams, agents=endpoint)
        group = await run_group(ctx, CFG, task, max_turns=8, retries=0, worker_id="w")
    for traj in group.trajectories:
        assert traj.finish_reason is FinishReason.TERMINATED and len(traj.turns) == 6
        assert traj.timings["agent/summaries"] == 3.0
        # calls 3 and 5 follow a rewritten history, so they must start segments
        starts = [t.segment_start for t in traj.turns]
        assert starts[2] and starts[4] and not starts[0]
        assert 0.0 <= traj.turns[-1].reward <= 1.0
