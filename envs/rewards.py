"""Reward functions: a user's ``pkg.module:fn`` or a built-in, resolved by name and called
within a time limit.

A reward function is called with the keyword arguments it names, out of:

- ``completion``: the model's final reply (text);
- ``messages``: the whole conversation in chat format (the prompt's messages, then each
  assistant reply and tool result), for multi-turn episodes;
- ``row``: the dataset row, every column of it;
- ``answer``: the row's answer column (None where there is none);
- ``sandbox``: the worker's sandbox pool (None where the worker has none).

It may be sync or async. It returns a number (bool and int count), or a dict of named
numbers: the reward is then their sum, and each component is reported on its own (the
worker's ``farm_worker_reward_component`` histogram). Sync functions run on a small thread
pool, so a slow one never stalls the worker's event loop.

Invariant: a reward function that raises, times out (``reward_timeout_s``) or returns
something that is not a finite number is an infrastructure failure: `score` raises
``EnvInfraError`` (category ``ENV``), which the worker records on the trajectory, and the
learner never trains on the episode. It is never scored 0 against the model.

Built-ins: ``math`` (`envs.reward_math`: math-verify), ``exact`` (the reply, stripped, is the
answer), ``regex`` (the answer is a regular expression the reply matches, ``re.search``) and
``code`` (`envs.reward_code`: the row's tests run in the sandbox, as the ``code`` env runs
them).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from broker.messages import ErrorCategory
from envs.errors import EnvInfraError, EnvSpecError
from envs.toy import TRAILING_SPECIALS

RewardFn = Callable[..., Any]
ARGUMENTS = ("completion", "messages", "row", "answer", "sandbox")

# Sync reward functions run here. A call that never returns keeps its thread (Python cannot
# stop one); the time limit still answers the episode, as an infrastructure failure.
_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="reward")


def reply_text(completion: str) -> str:
    """The reply without the end-of-turn specials a worker's decode may leave on it."""
    return TRAILING_SPECIALS.sub("", completion).strip()


def exact(completion: str, answer: Any) -> float:
    """1 when the reply, stripped, is the answer (as text), else 0."""
    if answer is None:
        raise ValueError("the row has no answer to compare with")
    return 1.0 if reply_text(completion) == str(answer).strip() else 0.0


def regex(completion: str, answer: Any) -> float:
    """1 when the answer, a regular expression, matches somewhere in the reply, else 0."""
    if not isinstance(answer, str):
        raise ValueError(f"the row's answer must be a regular expression, got {answer!r}")
    return 1.0 if re.search(answer, reply_text(completion)) else 0.0


BUILTINS: dict[str, str] = {
    "math": "envs.reward_math:math_reward",
    "exact": "envs.rewards:exact",
    "regex": "envs.rewards:regex",
    "code": "envs.reward_code:code_reward",
}


@dataclass(frozen=True)
class Reward:
    """A resolved reward function and what it is called with."""

    name: str  # as given: a built-in's name or "pkg.module:fn"
    fn: RewardFn
    takes: frozenset[str]  # which of ARGUMENTS it names (all of them for **kwargs)
    is_async: bool


@functools.lru_cache(maxsize=64)
def resolve(name: str) -> Reward:
    """The reward function `name` names; `EnvSpecError` when it cannot be imported."""
    target = BUILTINS.get(name, name)
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise EnvSpecError(
            f"reward {name!r}: give a built-in ({', '.join(BUILTINS)}) or pkg.module:function"
        )
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise EnvSpecError(f"reward {name!r} could not be loaded: {exc}") from exc
    if not callable(found):
        raise EnvSpecError(f"reward {name!r} is not callable")
    try:
        params = inspect.signature(found).parameters
    except (TypeError, ValueError):
        params = {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = frozenset(ARGUMENTS)
    else:
        takes = frozenset(ARGUMENTS) & set(params)
    if not takes:
        raise EnvSpecError(f"reward {name!r} takes none of {', '.join(ARGUMENTS)}")
    is_async = inspect.iscoroutinefunction(found) or inspect.iscoroutinefunction(
        getattr(found, "__call__", None)  # noqa: B004 -- a callable object's async __call__
    )
    return Reward(name, found, takes, is_async)


async def score(
    reward: Reward, timeout_s: float, **arguments: Any
) -> tuple[float, dict[str, float]]:
    """Call `reward` with the arguments it takes; the reward and its named components (empty
    for a plain number). Raises `EnvInfraError` on a raise, a timeout or a bad return."""
    given = {k: v for k, v in arguments.items() if k in reward.takes}
    try:
        async with asyncio.timeout(timeout_s):
            if reward.is_async:
                value = await reward.fn(**given)
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(_THREADS, functools.partial(reward.fn, **given))
    except TimeoutError:
        raise EnvInfraError(
            f"reward function {reward.name!r} took longer than {timeout_s:g}s", ErrorCategory.ENV
        ) from None
    except EnvInfraError:
        raise  # the sandbox's own failure keeps its category
    except Exception as exc:  # the user's code: whatever it raises is not the model's fault
        raise EnvInfraError(
            f"reward function {reward.name!r} raised {type(exc).__name__}: {exc}"[:500],
            ErrorCategory.ENV,
        ) from exc
    return _checked(reward.name, value)


def _checked(name: str, value: Any) -> tuple[float, dict[str, float]]:
    if isinstance(value, dict):
        parts = {str(k): _number(name, v, f"component {k!r}") for k, v in value.items()}
        if not parts:
            raise EnvInfraError(
                f"reward function {name!r} returned an empty dict", ErrorCategory.ENV
            )
        return sum(parts.values()), parts
    return _number(name, value, "its value"), {}


def _number(name: str, value: Any, what: str) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise EnvInfraError(
        f"reward function {name!r}: {what} is {value!r}, not a finite number", ErrorCategory.ENV
    )
