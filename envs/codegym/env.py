"""The ``codegym`` environment: tool use over a coding problem whose state lives in the sandbox.

At reset the environment opens a sandbox session for the episode and
instantiates the class there with a task config (the runtime and the
environment's source travel with every request, so a session the sandbox had to
reopen still works). Every tool call then runs in that session against the committed
state snapshot, under ``tool_timeout_s``: the new state is committed only when
the call finishes cleanly in time; a timeout, a limit violation or an exception
in the tool leaves the state as it was and the observation is an error. The
agent ends with ``Done(answer)``: reward 1 if the answer matches, else 0.
Unknown tools and malformed calls are format errors. ``tools`` is read from the
source statically (``ast``), so it is known before the first reset.
"""

from __future__ import annotations

import json
import logging
import random
from contextlib import AsyncExitStack
from typing import Any

import pydantic

from broker.messages import ErrorCategory
from envs.api import ResetResult, StepResult
from envs.codegym.runner import Reply, run_request
from envs.codegym.sources import CodeGymSource, get_source, runtime_source
from envs.errors import EnvInfraError, EnvStateError
from envs.parsing import parse_tool_calls
from envs.registry import spec_config
from envs.sandboxed import PythonSession, SandboxPool, open_session, require_pool
from envs.toolenv import format_error

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You solve the task by calling tools, one or more per turn, written as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>. '
    "Finish by calling Done with your answer."
)


class CodeGymConfig(pydantic.BaseModel):
    """Configuration of a codegym environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    env: str = pydantic.Field(
        description="environment name (a built-in or an admitted user source)"
    )
    config_index: int | None = pydantic.Field(
        None, ge=0, description="fixed task config; else the seed picks"
    )
    tool_timeout_s: float = pydantic.Field(
        2.0, gt=0, le=60, description="time limit of one tool call"
    )
    max_output_chars: int = pydantic.Field(
        2000, ge=16, description="tool output shown to the agent"
    )


class CodeGym:
    """Host side of one codegym environment; the class itself only runs in the sandbox."""

    system_prompt = SYSTEM_PROMPT
    action_vocabulary: tuple[str, ...] | None = None

    def __init__(
        self,
        config: CodeGymConfig,
        sandbox: SandboxPool | None,
        source: CodeGymSource | None = None,
    ) -> None:
        self.config = config
        self.pool = require_pool(sandbox, "codegym")
        self.source = source or get_source(config.env)
        if config.config_index is not None and config.config_index >= len(self.source.configs):
            raise ValueError(
                f"config_index {config.config_index} out of range ({len(self.source.configs)} configs)"
            )
        self.tools: list[dict[str, Any]] | None = list(self.source.tools)
        self._stack: AsyncExitStack | None = None
        self._sb: PythonSession | None = None
        self._state: str | None = None  # committed snapshot (JSON text)
        self._done = True

    def _files(self) -> dict[str, str]:
        # Shipped with every call: a session the sandbox had to reopen starts empty.
        return {
            "codegym_runtime.py": runtime_source(),
            f"{self.source.name}.py": self.source.source,
        }

    def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"op": op, "module": self.source.name, "class": self.source.class_name, **fields}

    async def _close_session(self) -> None:
        stack, self._stack, self._sb = self._stack, None, None
        if stack is None:
            return
        try:
            await stack.aclose()
        except EnvInfraError as exc:
            # The episode is over either way; a failed release is the pool's to reap.
            log.warning("codegym: closing the sandbox session failed: %s", exc)

    async def areset(self, seed: int | None = None) -> ResetResult:
        await self._close_session()
        index = self.config.config_index
        if index is None:
            index = random.Random(seed).randrange(len(self.source.configs))
        stack = AsyncExitStack()
        try:
            self._sb = await stack.enter_async_context(open_session(self.pool))
            self._stack = stack
        except BaseException:
            await stack.aclose()
            raise
        files = {
            "codegym_runtime.py": runtime_source(),
            f"{self.source.name}.py": self.source.source,
        }
        request = self._request("init", config=self.source.configs[index])
        reply = await run_request(
            self._sb, request, state=None, limit_s=self.config.tool_timeout_s, files=files
        )
        if not reply.ok:
            await self._close_session()
            raise EnvInfraError(
                f"codegym {self.source.name!r} failed to start: {reply.problem}", ErrorCategory.ENV
            )
        self._state = json.dumps(reply.data["state"])
        self._done = False
        return str(reply.data["task"]), {"env": self.source.name, "config_index": index}

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, Reply]:
        assert self._sb is not None  # astep checked
        request = self._request("call", tool=name, arguments=arguments)
        reply = await run_request(
            self._sb, request, state=self._state, limit_s=self.config.tool_timeout_s
        )
        if not reply.ok:
            return f"Error: {name} {reply.problem}; the state is unchanged.", reply
        if "format_error" in reply.data:
            return f"Error: {reply.data['format_error']}", reply
        if "tool_error" in reply.data:
            return (
                f"Error: {name} failed: {reply.data['tool_error']}; the state is unchanged.",
                reply,
            )
        self._state = json.dumps(reply.data["state"])  # commit
        return str(reply.data["output"])[: self.config.max_output_chars], reply

    async def astep(self, action: Any) -> StepResult:
        if self._done or self._sb is None:
            raise EnvStateError("codegym: step() before reset() or after the episode ended")
        parsed = parse_tool_calls(action)
        if parsed.error is not None:
            return f"Error: {parsed.error}", 0.0, False, False, format_error(parsed.error)
        if not parsed.calls:
            return (
                "Error: no tool call found. Call a tool, or Done(answer).",
                0.0,
                False,
                False,
                format_error("no tool call"),
            )
        outputs: list[str] = []
        info: dict[str, Any] = {}
        for call in parsed.calls:
            text, reply = await self._call(call.name, call.arguments)
            outputs.append(text)
            if "format_error" in reply.data:
                info.update(format_error(reply.data["format_error"]))
                break
            if not reply.ok or "tool_error" in reply.data:
                info["tool_error"] = reply.problem or reply.data.get("tool_error", "")
                info["rolled_back"] = True
                break
            if reply.data.get("done"):
                self._done = True
                await self._close_session()
                return "\n".join(outputs), float(reply.data["reward"]), True, False, info
        return "\n".join(outputs), 0.0, False, False, info

    async def aclose(self) -> None:
        self._done = True
        await self._close_session()


@spec_config(CodeGymConfig)
def make_codegym_env(env: str, sandbox: SandboxPool | None = None, **kwargs: Any) -> CodeGym:
    """Registry factory for ``codegym@{"env": name, ...}``; kwargs are CodeGymConfig fields."""
    return CodeGym(CodeGymConfig(env=env, **kwargs), sandbox)
