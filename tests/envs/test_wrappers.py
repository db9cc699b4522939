"""Wrappers: max turns and horizon schedule, observation history, tracking, tool caps."""

from __future__ import annotations

import pytest

import envs
from envs.wrappers import (
    EpisodeTracker,
    HorizonSchedule,
    MaxTurns,
    ObservationFormat,
    ToolCallLimit,
)


class Walk:
    """Sync env: terminates when the walker reaches `goal`; rewards 1 per step."""

    system_prompt = "walk"

    def __init__(self, goal: int = 100) -> None:
        self.goal = goal
        self.actions: list[str] = []

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.pos = 0
        return "at 0", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.actions.append(action)
        self.pos += 1
        return f"at {self.pos}", 1.0, self.pos >= self.goal, False, {}


async def _run(env: object, steps: int, action: str = "go") -> list[tuple]:
    await envs.areset(env, seed=0)
    out = []
    for _ in range(steps):
        out.append(await envs.astep(env, action))
        if out[-1][2] or out[-1][3]:
            break
    return out


async def test_max_turns_truncates_not_terminates() -> None:
    env = MaxTurns(Walk(), 3)
    assert env.system_prompt == "walk"  # attributes pass through
    steps = await _run(env, 10)
    assert len(steps) == 3
    assert [s[3] for s in steps] == [False, False, True] and not any(s[2] for s in steps)
    assert steps[-1][4]["truncated_by"] == "max_turns"
    # A terminal step at the limit is terminated, not truncated.
    steps = await _run(MaxTurns(Walk(goal=2), 2), 10)
    assert (steps[-1][2], steps[-1][3]) == (True, False) and "truncated_by" not in steps[-1][4]
    with pytest.raises(ValueError):
        MaxTurns(Walk(), 0)


async def test_horizon_schedule_rises_every_k_steps() -> None:
    schedule = HorizonSchedule(start=2, increment=2, every=10, maximum=7)
    assert [schedule.limit(s) for s in (0, 9, 10, 25, 30, 1000)] == [2, 2, 4, 6, 7, 7]
    env = MaxTurns(Walk(), schedule)
    assert len(await _run(env, 50)) == 2
    env.set_training_step(20)
    assert len(await _run(env, 50)) == 6
    with pytest.raises(ValueError):
        HorizonSchedule(start=0, every=1, maximum=3)


async def test_observation_history_and_latest() -> None:
    env = ObservationFormat(Walk(), "history")
    obs, _ = await envs.areset(env, seed=0)
    assert obs == "Observation: at 0"
    await envs.astep(env, "left")
    obs = (await envs.astep(env, "right"))[0]
    assert (
        obs
        == "Observation: at 0\nAction: left\nObservation: at 1\nAction: right\nObservation: at 2"
    )
    env = ObservationFormat(Walk(), "history", max_chars=10)
    await envs.areset(env)
    assert (await envs.astep(env, "x"))[0] == "tion: at 1"
    latest = ObservationFormat(Walk(), "latest")
    await envs.areset(latest)
    assert (await envs.astep(latest, "x"))[0] == "at 1"
    with pytest.raises(ValueError):
        ObservationFormat(Walk(), "all")  # type: ignore[arg-type]


async def test_episode_tracker_counts_and_resets() -> None:
    env = EpisodeTracker(MaxTurns(Walk(), 3))
    steps = await _run(env, 10)
    assert [(s[4]["episode_steps"], s[4]["episode_return"]) for s in steps] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
    ]
    assert steps[-1][4]["episode_done"] and "episode_done" not in steps[0][4]
    _, info = await envs.areset(env)
    assert (info["episode_steps"], info["episode_return"]) == (0, 0.0)


def _call(name: str, **args: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


async def test_tool_call_cap_truncates() -> None:
    inner = Walk()
    env = ToolCallLimit(inner, max_calls=2, max_repeats=5)
    await envs.areset(env)
    assert (await envs.astep(env, _call("a", i=1)))[4]["tool_calls"] == 1
    await envs.astep(env, _call("a", i=2))
    _, reward, terminated, truncated, info = await envs.astep(env, _call("a", i=3))
    assert (reward, terminated, truncated, info["truncated_by"]) == (0.0, False, True, "tool_calls")
    assert len(inner.actions) == 2  # the over-limit call never reached the env
    await envs.areset(env)
    assert not (await envs.astep(env, _call("a", i=1)))[3]  # counts reset per episode


async def test_repeated_identical_calls_detected() -> None:
    inner = Walk()
    env = ToolCallLimit(inner, max_calls=10, max_repeats=2)
    await envs.areset(env)
    await envs.astep(env, _call("look", at="door"))
    await envs.astep(env, _call("look", at="window"))  # different arguments: not a repeat
    await envs.astep(env, _call("look", at="door"))
    obs, _, _, truncated, info = await envs.astep(env, _call("look", at="door"))
    assert truncated and info["truncated_by"] == "repeated_tool_call" and "repeated" in obs
    assert len(inner.actions) == 3
    warn = ToolCallLimit(Walk(), max_calls=10, max_repeats=1, on_repeat="warn")
    await envs.areset(warn)
    await envs.astep(warn, _call("look"))
    obs, _, _, truncated, info = await envs.astep(warn, _call("look"))
    assert not truncated and info["repeated_tool_call"] == "look"
    assert not (await envs.astep(warn, _call("open")))[3]
