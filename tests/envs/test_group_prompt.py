"""A group is n samples of ONE prompt: every built-in environment draws its prompt from the
reset seed alone, so the episodes of a group (all reset with `task.seed`) see the same one.

Two fresh instances reset with the same seed give the same observation and info; across
seeds the prompt changes (the seed is not ignored). `http` passes the seed on as the remote
environment's `data_idx` (tests/envs/test_http.py); `agent` hands the agent `task.seed`
(tests/workers/test_group_seeds.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import envs

POOL_FREE = [
    "toy",
    'toy@{"difficulty": 1}',
    'toy@{"difficulty": 3, "instructions": true}',
    "lookup",
    'lookup@{"choose": true}',
]
SANDBOXED = [
    "code@" + json.dumps({"timeout_s": 3}),
    "codegym@" + json.dumps({"env": "max_subarray"}),
    "stateful",  # the seed picks the scenario
]


async def _prompt(spec: str, seed: int, pool: Any = None) -> tuple[Any, str]:
    env = envs.make(spec, sandbox=pool) if pool is not None else envs.make(spec)
    try:
        obs, info = await envs.areset(env, seed=seed)
    finally:
        await envs.aclose(env, 30.0)
    return obs, json.dumps(info, sort_keys=True, default=str)


async def _check(spec: str, pool: Any = None) -> None:
    seeds = range(100, 112)
    first = [await _prompt(spec, s, pool) for s in seeds]
    again = [await _prompt(spec, s, pool) for s in seeds]
    assert first == again, f"{spec}: two episodes reset with one seed saw different prompts"
    assert len(set(map(str, first))) > 1, f"{spec}: the seed does not choose the prompt"


@pytest.mark.parametrize("spec", POOL_FREE)
async def test_one_seed_one_prompt(spec: str) -> None:
    await _check(spec)


@pytest.mark.bwrap
@pytest.mark.parametrize("spec", SANDBOXED)
async def test_one_seed_one_prompt_in_the_sandbox(spec: str, bwrap_pool: Any) -> None:
    await _check(spec, bwrap_pool)
