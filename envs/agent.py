"""The `agent` environment kind: a user's OpenAI-SDK agent program as an environment.

Two ways to bring an agent:

- a Python function, ``agent@{"entry": "pkg.module:function", "task": {...}, "use_sandbox":
  false, ...limits}``: the worker calls ``await function(task, openai)`` in its own process
  (plus ``sandbox=<SandboxPool>`` when ``"use_sandbox": true``), where ``openai`` is an
  `OpenAIConfig` whose `base_url` and `api_key` reach the worker's token-capturing endpoint
  for this episode only (in the worker's process, `client_kwargs()` also carries an httpx
  client that calls the endpoint directly, with no HTTP); it returns the reward, a float or ``{"reward": float, "metrics":
  {...}}``;
- a program in the sandbox, ``agent@{"command": ["python3", "agent.py"], "files":
  {"agent.py": "host/path.py"}, "task": <terminal task>, ...limits}``: each episode opens a
  sandbox session, runs the task's setup, copies ``files`` into the work dir and runs
  ``command`` there with no network; it sees ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (this
  episode's endpoint, over the session's bridge), ``OPENAI_MODEL`` and ``FARM_PROMPT`` (the
  task's prompt). The reward is the task's check, run in the session after the program
  exits, as for `terminal` tasks: 1.0 when it exits 0. ``task`` names a built-in terminal
  task, or gives one as ``{"name", "prompt", "setup", "check"}``, or a list of those (the
  group's seed picks one). Processes the program leaves behind end with it.

Building the spec resolves the entry point and reads ``files``, so a typo is an
`EnvSpecError` (dead letter), not an episode failure.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from envs.errors import EnvSpecError
from envs.registry import spec_config
from envs.terminal import TASKS, TerminalTask


class AgentConfig(BaseModel):
    """Kwargs of an `agent` spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    entry: str | None = Field(
        None, description="`pkg.module:function`, an async function (task, openai)"
    )
    command: list[str] | None = Field(
        None, min_length=1, description="argv of a program run in a sandbox session instead"
    )
    files: dict[str, str] = Field(
        {}, description="with `command`: work-dir path -> host file copied there first"
    )
    task: Any = Field(
        None,
        description="the function's task (any JSON); with `command`, terminal task(s)",
    )
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

    @model_validator(mode="after")
    def _one_agent(self) -> AgentConfig:
        if (self.entry is None) == (self.command is None):
            raise ValueError("give exactly one of 'entry' (a function) and 'command' (a program)")
        if self.command is not None and self.use_sandbox:
            raise ValueError("'use_sandbox' is for functions; a command always runs in one")
        if self.files and self.command is None:
            raise ValueError("'files' go with 'command'")
        return self


@dataclass(frozen=True)
class OpenAIConfig:
    """How the agent reaches the policy: an OpenAI-compatible server scoped to one episode."""

    base_url: str  # e.g. http://127.0.0.1:41234/v1
    api_key: str  # the episode's key; expires when the episode ends
    model: str  # the served model name (any name is accepted)
    seed: int  # the task's seed, shared by the group's episodes: pick the problem with it
    # a fresh `httpx.AsyncClient` that reaches the endpoint in this process, with no HTTP
    # (`workers.agent_transport`); None: over `base_url`
    http_client: Callable[[], Any] | None = field(default=None, compare=False, repr=False)

    def client_kwargs(self) -> dict[str, Any]:
        """Kwargs for `openai.AsyncOpenAI(...)`: no SDK retries, so a refused call (a limit)
        reaches the agent at once, and the in-process client where there is one. A sync
        `openai.OpenAI` (run in a thread) takes `base_url` and `api_key` alone."""
        kwargs = {"base_url": self.base_url, "api_key": self.api_key, "max_retries": 0}
        if self.http_client is not None:
            kwargs["http_client"] = self.http_client()
        return kwargs


@dataclass(frozen=True)
class AgentEnv:
    """A resolved `agent` spec: what the worker needs to run one episode of it."""

    config: AgentConfig
    function: Callable[..., Any] | None  # the user's async function (None: a command)
    tasks: tuple[TerminalTask, ...] = ()  # a command's tasks; the group's seed picks one
    files: tuple[tuple[str, bytes], ...] = ()  # a command's files: (work-dir path, contents)

    @property
    def in_sandbox(self) -> bool:
        return self.config.command is not None

    def pick(self, seed: int) -> TerminalTask:
        return self.tasks[seed % len(self.tasks)]


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
    if config.entry is not None:
        return AgentEnv(config, resolve_entry(config.entry))
    return AgentEnv(config, None, _terminal_tasks(config.task), _read_files(config.files))


def _terminal_tasks(task: Any) -> tuple[TerminalTask, ...]:
    """A command's task(s): built-in terminal task names or inline task objects."""
    items = task if isinstance(task, list) else [task]
    out = []
    for item in items:
        if isinstance(item, str) and item in TASKS:
            out.append(TASKS[item])
        elif isinstance(item, dict) and {"prompt", "check"} <= set(item) <= _TASK_KEYS:
            fields = {"name": "inline", "setup": "", **item}
            if not all(isinstance(v, str) for v in fields.values()):
                raise EnvSpecError(f"agent task {item!r}: every field must be a string")
            out.append(TerminalTask(**fields))
        else:
            raise EnvSpecError(
                f"agent task {item!r}: name a terminal task ({sorted(TASKS)}) or give "
                '{"prompt", "check", optional "setup" and "name"}'
            )
    if not out:
        raise EnvSpecError("agent: a command needs at least one task")
    return tuple(out)


_TASK_KEYS = {"name", "prompt", "setup", "check"}


def _read_files(files: dict[str, str]) -> tuple[tuple[str, bytes], ...]:
    out = []
    for target, source in files.items():
        try:
            out.append((target, Path(source).read_bytes()))
        except OSError as exc:
            raise EnvSpecError(f"agent file {target!r}: cannot read {source}: {exc}") from None
    return tuple(out)
