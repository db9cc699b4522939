"""``ToolEnv``: a base class for environments whose tools are Python methods.

A subclass marks methods with ``@tool``; they become ``tools`` (OpenAI schemas).
Each step parses the action (any syntax ``envs.parsing`` knows), runs the calls in
order and returns their results as the observation. A malformed call, an unknown
tool or bad arguments produce an error observation and
``info["error"] == ErrorCategory.FORMAT`` with a zero reward; the episode goes on.
A subclass ends the episode by calling ``self.end_episode(reward)`` from a tool.
Tools may be coroutines.
"""

from __future__ import annotations

import inspect
from typing import Any

from broker.messages import ErrorCategory
from envs.api import Env, ResetResult, StepResult
from envs.errors import EnvStateError
from envs.parsing import ParsedAction, parse_tool_calls
from envs.tools import ToolCallError, bind_tool_call, tool_schemas


def format_error(detail: str) -> dict[str, Any]:
    """The info entries of a step whose action could not be used (the model's fault)."""
    return {"error": ErrorCategory.FORMAT, "error_detail": detail[:500]}


class ToolEnv(Env):
    """Multi-turn environment driven by ``@tool`` methods; subclasses implement ``setup``."""

    no_call_message = "Error: no tool call found. Call one of the tools."

    def __init__(self) -> None:
        self.tools = tool_schemas(self)
        self._done = True
        self._reward = 0.0

    def setup(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        """Start an episode; return the first observation and info."""
        raise NotImplementedError

    def end_episode(self, reward: float) -> None:
        """End the episode with ``reward`` (called from a tool)."""
        self._done, self._reward = True, float(reward)

    async def areset(self, seed: int | None = None) -> ResetResult:
        self._done, self._reward = False, 0.0
        result = self.setup(seed)
        return await result if inspect.isawaitable(result) else result

    async def run_call(self, parsed: ParsedAction) -> tuple[list[str], dict[str, Any]]:
        """Run the parsed calls in order until one fails or ends the episode."""
        outputs: list[str] = []
        for call in parsed.calls:
            try:
                method, kwargs = bind_tool_call(self, call)
            except ToolCallError as exc:
                outputs.append(f"Error: {exc}")
                return outputs, format_error(str(exc))
            result = method(**kwargs)
            result = await result if inspect.isawaitable(result) else result
            outputs.append(str(result))
            if self._done:
                break
        return outputs, {}

    async def astep(self, action: Any) -> StepResult:
        if self._done:
            raise EnvStateError(f"{type(self).__name__}: step() before reset() or after the end")
        parsed = parse_tool_calls(action)
        if parsed.error is not None:
            return f"Error: {parsed.error}", 0.0, False, False, format_error(parsed.error)
        if not parsed.calls:
            return self.no_call_message, 0.0, False, False, format_error("no tool call")
        outputs, info = await self.run_call(parsed)
        reward = self._reward if self._done else 0.0
        return "\n".join(outputs), reward, self._done, False, info
