"""The `agent` environment kind: a user's OpenAI-SDK agent program as an environment.

Spec: ``agent@{"entry": "pkg.module:function", "task": {...}, "use_sandbox": false, ...limits}``.
The worker runs each episode by calling ``await function(task, openai)`` (plus
``sandbox=<SandboxPool>`` when ``"use_sandbox": true``), where ``openai`` is an `OpenAIConfig`
whose `base_url` and `api_key` reach the worker's token-capturing endpoint for this episode
only. The function returns the reward: a float, or ``{"reward": float, "metrics": {...}}``.
Building the spec resolves the entry point, so a typo is an `EnvSpecError` (dead letter),
not an episode failure.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from envs.errors import EnvSpecError
from envs.registry import spec_config


class AgentConfig(BaseModel):
    """Kwargs of an `agent` spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: str = Field(description="`pkg.module:function`, an async function (task, openai)")
    task: Any = Field(None, description="JSON value handed to the function as its task")
    use_sandbox: bool = Field(
        False, description="also pass the worker's sandbox pool as `sandbox=`"
    )
    max_calls: int = Field(32, ge=1, description="chat completion calls per episode")
    max_completion_tokens: int = Field(
        8192, ge=1, description="tokens generated over the whole episode"
    )
    max_context_tokens: int | None = Field(
        None, ge=1, description="prompt + completion of one call (None: --max-context-tokens)"
    )
    wall_time_s: float | None = Field(
        None, gt=0, description="seconds for the whole episode (None: --episode-timeout-s)"
    )


@dataclass(frozen=True)
class OpenAIConfig:
    """How the agent reaches the policy: an OpenAI-compatible server scoped to one episode."""

    base_url: str  # e.g. http://127.0.0.1:41234/v1
    api_key: str  # the episode's key; expires when the episode ends
    model: str  # the served model name (any name is accepted)
    seed: int  # the task's seed, shared by the group's episodes: pick the problem with it

    def client_kwargs(self) -> dict[str, Any]:
        """Kwargs for `openai.OpenAI(...)` / `openai.AsyncOpenAI(...)`: no SDK retries, so a
        refused call (a limit) reaches the agent at once."""
        return {"base_url": self.base_url, "api_key": self.api_key, "max_retries": 0}


@dataclass(frozen=True)
class AgentEnv:
    """A resolved `agent` spec: what the worker needs to run one episode of it."""

    config: AgentConfig
    function: Callable[..., Any]  # the user's async function


def resolve_entry(entry: str) -> Callable[..., Any]:
    """The async function `entry` ("pkg.module:function") names; EnvSpecError otherwise."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise EnvSpecError(f"agent entry {entry!r} must look like 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvSpecError(f"agent entry {entry!r}: cannot import {module_name}: {exc}") from None
    function = getattr(module, attr, None)
    if function is None:
        raise EnvSpecError(f"agent entry {entry!r}: {module_name} has no {attr!r}")
    if not inspect.iscoroutinefunction(function):
        raise EnvSpecError(f"agent entry {entry!r} must be an async function")
    return function


@spec_config(AgentConfig)
def make_agent_env(**kwargs: Any) -> AgentEnv:
    """Registry factory for ``agent@{...}``."""
    config = AgentConfig(**kwargs)
    return AgentEnv(config, resolve_entry(config.entry))
