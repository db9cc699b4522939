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
