"""The environment API: a Gymnasium/GEM-shaped protocol and the async drivers.

An environment is any object with ``reset(seed=None) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``; environments
that do I/O may instead (or also) offer ``areset``/``astep``/``aclose`` coroutines.
``areset``/``astep``/``aclose`` here drive either kind, so a plain Gymnasium or GEM
environment runs unchanged. Optional attributes ``system_prompt``, ``tools`` and
``action_vocabulary`` are read with ``getattr`` defaults (see ``Env``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

StepResult = tuple[Any, float, bool, bool, dict[str, Any]]
ResetResult = tuple[Any, dict[str, Any]]


class Env:
    """Convenience base class for environments written for this package.

    Subclasses override ``reset``/``step`` (sync) or ``areset``/``astep`` (async).
    The class attributes are the optional per-environment chat metadata the worker reads.
    """

    system_prompt: str | None = None  # optional system message for the chat template
    tools: list[dict[str, Any]] | None = None  # OpenAI tool JSON schemas
    action_vocabulary: tuple[str, ...] | None = None  # restrict sampling to these strings

    def reset(self, *, seed: int | None = None) -> ResetResult:
        raise NotImplementedError

    def step(self, action: Any) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources; the default holds none."""


@functools.lru_cache(maxsize=1024)
def _function_accepts_seed(function: Any) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _accepts_seed(method: Any) -> bool:
    # Signatures are cached per underlying function: inspecting on every reset costs more
    # than a toy episode.
    function = getattr(method, "__func__", method)
    try:
        return _function_accepts_seed(function)
    except TypeError:  # unhashable callable
        return _function_accepts_seed.__wrapped__(function)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def areset(env: Any, seed: int | None = None) -> ResetResult:
    """Reset ``env`` (sync or async) and return ``(observation, info)``.

    Old-style environments whose ``reset`` takes no seed are reset without one; a
    ``reset`` that returns a bare observation gets an empty info dict.
    """
    method = getattr(env, "areset", None) or env.reset
    result = method(seed=seed) if _accepts_seed(method) else method()
    result = await _maybe_await(result)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result[0], result[1]
    return result, {}


async def astep(env: Any, action: Any) -> StepResult:
    """Step ``env`` (sync or async) and return the five-tuple.

    A legacy four-tuple ``(obs, reward, done, info)`` is mapped to
    ``terminated=done, truncated=False``.
    """
    method = getattr(env, "astep", None) or env.step
    result = await _maybe_await(method(action))
    if len(result) == 4:
        obs, reward, done, info = result
        return obs, float(reward), bool(done), False, dict(info)
    obs, reward, terminated, truncated, info = result
    return obs, float(reward), bool(terminated), bool(truncated), dict(info or {})


async def aclose(env: Any, timeout_s: float | None = None) -> None:
    """Close ``env`` if it has ``aclose`` or ``close``; a missing close is fine.

    ``timeout_s`` bounds an asynchronous close (TimeoutError beyond it). A synchronous
    one runs to its end: no timer could interrupt it, so none is armed.
    """
    method = getattr(env, "aclose", None) or getattr(env, "close", None)
    if method is None:
        return
    result = method()
    if inspect.isawaitable(result):
        async with asyncio.timeout(timeout_s):
            await result
