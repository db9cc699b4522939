"""The API drivers: sync, async, Gymnasium-shaped and legacy environments."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import envs


class GymShaped:
    """A plain class with the Gymnasium shape, written without this package."""

    def __init__(self) -> None:
        self.closed = False
        self.pos = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[int, dict]:
        self.pos = (seed or 0) % 3
        return self.pos, {"seeded": seed}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict]:
        self.pos += action
        return self.pos, float(action), self.pos >= 5, False, {}

    def close(self) -> None:
        self.closed = True


class AsyncOnly:
    system_prompt = "be async"

    async def areset(self, seed: int | None = None) -> tuple[str, dict]:
        return f"start-{seed}", {}

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return action.upper(), 0.5, False, True, {"echo": action}

    async def aclose(self) -> None:
        self.closed = True


class Legacy:
    """Old gym: reset() without seed returning a bare obs, step() returning 4 values."""

    def reset(self) -> str:
        return "legacy"

    def step(self, action: str) -> tuple[str, int, bool, dict]:
        return action, 1, True, {"old": True}


async def test_gymnasium_shaped_env_runs_unchanged() -> None:
    env = GymShaped()
    obs, info = await envs.areset(env, seed=4)
    assert (obs, info) == (1, {"seeded": 4})
    obs, reward, terminated, truncated, _ = await envs.astep(env, 2)
    assert (obs, reward, terminated, truncated) == (3, 2.0, False, False)
    obs, _, terminated, _, _ = await envs.astep(env, 2)
    assert (obs, terminated) == (5, True)
    await envs.aclose(env)
    assert env.closed


async def test_async_env_uses_coroutines() -> None:
    env = AsyncOnly()
    assert await envs.areset(env, seed=7) == ("start-7", {})
    obs, reward, terminated, truncated, info = await envs.astep(env, "go")
    assert (obs, reward, terminated, truncated, info) == ("GO", 0.5, False, True, {"echo": "go"})
    await envs.aclose(env)
    assert env.closed


async def test_legacy_env_is_adapted() -> None:
    env = Legacy()
    assert await envs.areset(env, seed=1) == ("legacy", {})
    assert await envs.astep(env, "x") == ("x", 1.0, True, False, {"old": True})
    await envs.aclose(env)  # no close method: nothing to do, no error


async def test_a_hanging_async_close_is_bounded_and_a_sync_close_runs() -> None:
    class Hangs:
        async def aclose(self) -> None:
            await asyncio.sleep(60)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await envs.aclose(Hangs(), timeout_s=0.1)
    assert time.monotonic() - started < 5

    class SlowSync:
        closed = False

        def close(self) -> None:
            time.sleep(0.2)
            self.closed = True

    env = SlowSync()
    await envs.aclose(env, timeout_s=0.01)  # no timer can stop a sync close: it finishes
    assert env.closed


async def test_env_base_defaults() -> None:
    env = envs.Env()
    assert env.system_prompt is None and env.tools is None and env.action_vocabulary is None
    with pytest.raises(NotImplementedError):
        await envs.areset(env)


class NeverEnds:
    """A GEM-shaped env that does not track its own end: it counts every step it gets."""

    def __init__(self, terminated: bool = True, truncated: bool = False) -> None:
        self.steps = 0
        self.ends = (terminated, truncated)

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        return "start", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.steps += 1
        return "obs", 0.0, *self.ends, {}


@pytest.mark.parametrize("ends", [(True, False), (False, True)])
async def test_a_step_after_the_end_raises_and_never_reaches_the_env(
    ends: tuple[bool, bool],
) -> None:
    env = NeverEnds(*ends)
    await envs.areset(env, seed=0)
    assert (await envs.astep(env, "a"))[2:4] == ends
    with pytest.raises(envs.EnvStateError, match="after the episode ended"):
        await envs.astep(env, "again")
    assert env.steps == 1
    await envs.areset(env, seed=1)  # a reset starts a new episode
    await envs.astep(env, "b")
    assert env.steps == 2


async def test_the_end_is_enforced_through_a_wrapper_and_on_legacy_envs() -> None:
    from envs.wrappers import MaxTurns

    inner = NeverEnds(terminated=False)
    wrapped = MaxTurns(inner, 1)  # the wrapper truncates; the inner env never ends
    await envs.areset(wrapped, seed=0)
    assert (await envs.astep(wrapped, "a"))[3] is True
    with pytest.raises(envs.EnvStateError):
        await envs.astep(wrapped, "b")
    assert inner.steps == 1
    legacy = Legacy()  # four-tuple done=True
    await envs.areset(legacy)
    await envs.astep(legacy, "x")
    with pytest.raises(envs.EnvStateError):
        await envs.astep(legacy, "y")
