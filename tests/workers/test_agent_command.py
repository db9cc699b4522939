"""Agent programs in the sandbox: the worker's group runner against a real CPU policy server,
a real sandbox pool (docker and bwrap) and the session's bridge to the endpoint."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from broker.messages import ErrorCategory, FinishReason, Task
from inference.client import SamplingParams
from sandbox import SandboxConfig, SandboxPool
from tests.sandbox.conftest import SOCKET_DIR, require_backend
from tests.workers.agent_helpers import serving
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group

CFG = EpisodeSettings(max_tokens=8, episode_timeout_s=60)

# one chat call over the bridge, then a file the check reads: the reward is the check's
ONE_CALL = """
import json, os, urllib.request
req = urllib.request.Request(
    os.environ['OPENAI_BASE_URL'] + '/chat/completions',
    data=json.dumps({'model': os.environ['OPENAI_MODEL'], 'max_tokens': 3,
                     'messages': [{'role': 'user', 'content': os.environ['FARM_PROMPT']}]}).encode(),
    headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'],
             'Content-Type': 'application/json'})
json.loads(urllib.request.urlopen(req, timeout=120).read())['choices'][0]['message']
open('answer.txt', 'w').write(open('seed.txt').read())
"""


@pytest.fixture(
    params=[
        pytest.param("docker", marks=pytest.mark.docker),
        pytest.param("bwrap", marks=pytest.mark.bwrap),
    ]
)
async def pool(request: pytest.FixtureRequest) -> AsyncIterator[SandboxPool]:
    require_backend(request.param)
    config = SandboxConfig(backend=request.param, warm=0, socket_dir=SOCKET_DIR)
    async with SandboxPool(config) as made:
        yield made


def _task(spec: dict[str, object], n: int = 2) -> Task:
    return Task("t-cmd", f"agent@{json.dumps(spec)}", group_size=n, seed=5, policy_version=3)


async def test_a_program_in_the_sandbox_is_recorded_and_scored_by_the_check(
    tiny_model_dir: Path, pool: SandboxPool
) -> None:
    solved = {"prompt": "copy", "setup": "echo 7 > seed.txt", "check": "grep -qx 7 answer.txt"}
    unsolved = {**solved, "check": "false"}
    async with serving(tiny_model_dir) as endpoint:
        ctx = EpisodeContext(
            endpoint.codec, endpoint.client, SamplingParams, sandbox=pool, agents=endpoint
        )
        rewards = []
        for task in (solved, unsolved):
            spec = {"command": ["python3", "-c", ONE_CALL], "task": task}
            group = await run_group(ctx, CFG, _task(spec), max_turns=8, retries=0, worker_id="w")
            for traj in group.trajectories:
                assert traj.error is ErrorCategory.NONE, traj.error_detail
                assert traj.finish_reason is FinishReason.TERMINATED
                assert len(traj.turns) == 1 and traj.timings["agent/exit_code"] == 0.0
            rewards.append([t.turns[-1].reward for t in group.trajectories])
        assert rewards == [[1.0, 1.0], [0.0, 0.0]]
        assert not endpoint._episodes  # every key expired with its episode


async def test_a_program_past_its_time_and_a_failed_setup_are_not_the_models_failures(
    tiny_model_dir: Path, pool: SandboxPool
) -> None:
    slow = {"command": ["sleep", "60"], "task": "serve-file", "wall_time_s": 1}
    broken = {"command": ["true"], "task": {"prompt": "p", "setup": "exit 3", "check": "true"}}
    async with serving(tiny_model_dir) as endpoint:
        ctx = EpisodeContext(
            endpoint.codec, endpoint.client, SamplingParams, sandbox=pool, agents=endpoint
        )
        timed_out, failed = [
            (
                await run_group(ctx, CFG, _task(s, 1), max_turns=8, retries=0, worker_id="w")
            ).trajectories[0]
            for s in (slow, broken)
        ]
    assert timed_out.error is ErrorCategory.TIMEOUT, timed_out.error_detail
    assert failed.error is ErrorCategory.SANDBOX and "setup" in failed.error_detail
