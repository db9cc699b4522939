"""The environment API: a Gymnasium/GEM-shaped protocol and the async drivers.

An environment is any object with ``reset(seed=None) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``; environments
that do I/O may instead (or also) offer ``areset``/``astep``/``aclose`` coroutines.
``areset``/``astep``/``aclose`` here drive either kind, so a plain Gymnasium or GEM
environment runs unchanged. Optional attributes ``system_prompt``, ``tools`` and
``action_vocabulary`` are read with ``getattr`` defaults (see ``Env``).

The end of an episode is enforced here: once ``astep`` has returned
``terminated`` or ``truncated``, the next ``astep`` raises ``EnvStateError``
until ``areset``, whether or not the environment tracks its own end (the flag
lives in the instance's ``__dict__``; an object without one is not tracked).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

from envs.errors import EnvSpecError, EnvStateError

StepResult = tuple[Any, float, bool, bool, dict[str, Any]]
ResetResult = tuple[Any, dict[str, Any]]

# Instance-dict key marking an environment whose episode has ended. Set through
# __dict__ so that a wrapper's attribute forwarding or a frozen class cannot hide it.
_ENDED = "_envs_episode_ended"


def _set_ended(env: Any, ended: bool) -> None:
    state = getattr(env, "__dict__", None)
    if state is not None:
        state[_ENDED] = ended


def _ended(env: Any) -> bool:
    state = getattr(env, "__dict__", None)
    return bool(state is not None and state.get(_ENDED))


class Env:
    """Convenience base class for environments written for this package.

    Subclasses override ``reset``/``step`` (sync) or ``areset``/``astep`` (async).
    The class attributes are the optional per-environment chat metadata the worker reads.
    """

    system_prompt: str | None = None  # optional system message for the chat template
    tools: list[dict[str, Any]] | None = None  # OpenAI tool JSON schemas
    action_vocabulary: tuple[str, ...] | None = None  # restrict sampling to these strings

    def reset(self, *, seed: int | None = None) -> ResetResult:
        """Start an episode. An environment that takes its problem from a dataset row adds
        ``options: dict | None = None`` and reads ``options["row"]``."""
        raise NotImplementedError

    def step(self, action: Any) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources; the default holds none."""


@functools.lru_cache(maxsize=1024)
def _function_accepts(function: Any, name: str) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _accepts(method: Any, name: str) -> bool:
    # Signatures are cached per underlying function: inspecting on every reset costs more
    # than a toy episode.
    function = getattr(method, "__func__", method)
    try:
        return _function_accepts(function, name)
    except TypeError:  # unhashable callable
        return _function_accepts.__wrapped__(function, name)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def areset(
    env: Any, seed: int | None = None, options: dict[str, Any] | None = None
) -> ResetResult:
    """Reset ``env`` (sync or async) and return ``(observation, info)``.

    ``options`` is Gymnasium's reset argument; a task's dataset row arrives in it as
    ``{"row": {...}}``. Old-style environments whose ``reset`` takes no seed are reset
    without one; options given to a ``reset`` that takes none raise ``EnvSpecError`` (the
    task cannot run there: its row would be dropped unseen). A ``reset`` that returns a
    bare observation gets an empty info dict.
    """
    method = getattr(env, "areset", None) or env.reset
    kwargs: dict[str, Any] = {"seed": seed} if _accepts(method, "seed") else {}
    if options is not None:
        if not _accepts(method, "options"):
            raise EnvSpecError(
                f"{type(env).__name__} takes no dataset row: its reset has no 'options' parameter"
            )
        kwargs["options"] = options
    result = await _maybe_await(method(**kwargs))
    _set_ended(env, False)
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        return result[0], result[1]
    return result, {}


async def astep(env: Any, action: Any) -> StepResult:
    """Step ``env`` (sync or async) and return the five-tuple.

    A legacy four-tuple ``(obs, reward, done, info)`` is mapped to
    ``terminated=done, truncated=False``. A step after the episode ended (before
    the next reset) raises ``EnvStateError`` without reaching the environment.
    """
    if _ended(env):
        raise EnvStateError(f"{type(env).__name__}: step() after the episode ended; reset() first")
    method = getattr(env, "astep", None) or env.step
    result = await _maybe_await(method(action))
    if len(result) == 4:
        obs, reward, done, info = result
        terminated, truncated = bool(done), False
    else:
        obs, reward, terminated, truncated, info = result
        terminated, truncated = bool(terminated), bool(truncated)
    if terminated or truncated:
        _set_ended(env, True)
    return obs, float(reward), terminated, truncated, dict(info or {})


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
