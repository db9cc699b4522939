"""The ``dataset`` environment: a prompt from a dataset row, rewarded by a reward function.

Each task carries its row (`broker.messages.Task.row`); the worker hands it over at reset
as ``options={"row": row}``. The first observation is the row's prompt column (text, a user
message) or its messages column (a list of chat messages, passed as they are). Single turn
by default: the reply ends the episode and the reward function (`envs.rewards`, named by
``reward``) scores it. With ``tools`` (``pkg.module:factory``, an object whose ``@tool``
methods become the model's tools, built per episode, with the row when the factory takes
``row``) it is multi-turn: a reply with tool calls gets their results back (as ``tool``
messages) and the episode goes on; the first reply without a tool call is the answer, and
``max_turns`` replies without one end the episode truncated, unscored.

``check_row`` is what a learner runs on every row at start-up, so a missing column or a
wrong type stops the run there, naming the row, instead of failing episodes later.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pydantic

from envs.api import Env, ResetResult, StepResult
from envs.errors import EnvSpecError, EnvStateError
from envs.parsing import parse_tool_calls
from envs.registry import spec_config
from envs.rewards import BUILTINS, resolve, score
from envs.sandboxed import SandboxPool
from envs.toolenv import format_error
from envs.tools import ToolCallError, bind_tool_call, tool_schemas


class DatasetEnvConfig(pydantic.BaseModel):
    """Configuration of the dataset environment: which columns, which reward."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    prompt_column: str = pydantic.Field("prompt", min_length=1, description="the prompt (text)")
    messages_column: str | None = pydantic.Field(
        None, min_length=1, description="chat messages as the prompt (instead of prompt_column)"
    )
    answer_column: str | None = pydantic.Field(
        "answer", min_length=1, description="what the reward compares with (None: no answer)"
    )
    reward: str = pydantic.Field(
        "exact", min_length=1, description=f"built-in ({', '.join(BUILTINS)}) or pkg.module:fn"
    )
    reward_timeout_s: float = pydantic.Field(
        30.0, gt=0.0, le=3600.0, description="a reward call longer than this is an infra failure"
    )
    system_prompt: str | None = pydantic.Field(None, description="system message before the prompt")
    tools: str | None = pydantic.Field(
        None, description="pkg.module:factory of an object with @tool methods (multi-turn)"
    )
    max_turns: int = pydantic.Field(
        8, ge=1, le=1000, description="replies with tool calls before the episode is cut"
    )


def check_row(config: DatasetEnvConfig, row: Any) -> None:
    """Raise ValueError when `row` cannot make an episode under `config`."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object of columns, got {type(row).__name__}")
    if config.messages_column is not None:
        _messages(row, config.messages_column)
    else:
        _prompt(row, config.prompt_column)
    if config.answer_column is not None and config.reward in BUILTINS:
        answer = row.get(config.answer_column)
        if answer is None:
            raise ValueError(f"column {config.answer_column!r} (the answer) is missing or null")
        if config.reward == "regex":
            try:
                re.compile(str(answer))
            except re.error as exc:
                raise ValueError(f"column {config.answer_column!r}: bad regex: {exc}") from None
        if config.reward == "code":
            from envs.reward_code import problem_of

            try:
                problem_of(answer)
            except (ValueError, pydantic.ValidationError) as exc:
                raise ValueError(f"column {config.answer_column!r}: bad tests: {exc}") from None


def _prompt(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value:
        got = "missing" if column not in row else type(value).__name__
        raise ValueError(f"column {column!r} (the prompt) must be non-empty text, got {got}")
    return value


def _messages(row: dict[str, Any], column: str) -> list[dict[str, Any]]:
    value = row.get(column)
    ok = isinstance(value, list) and value
    if ok:
        ok = all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    if not ok:
        raise ValueError(
            f"column {column!r} must be a non-empty list of {{'role': str, 'content': str}} messages"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


class DatasetEnv(Env):
    """A dataset row's prompt, scored by a reward function; see the module docstring."""

    def __init__(self, config: DatasetEnvConfig, sandbox: SandboxPool | None = None) -> None:
        self.config = config
        self.sandbox = sandbox
        self.reward = resolve(config.reward)  # EnvSpecError now, not at the first step
        self.system_prompt = config.system_prompt
        self._factory = _load_tools(config.tools) if config.tools else None
        self.tools: list[dict[str, Any]] | None = None  # the episode's toolbox's, at reset
        self._row: dict[str, Any] | None = None
        self._toolbox: Any = None
        self.messages: list[dict[str, Any]] = []
        self.turns = 0

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        row = (options or {}).get("row")
        try:
            check_row(self.config, row)
        except ValueError as exc:
            raise EnvSpecError(f"dataset env: the task's row is unusable: {exc}") from None
        assert isinstance(row, dict)
        self._row, self.turns = row, 0
        self._toolbox = self._factory(row) if self._factory else None
        self.tools = tool_schemas(self._toolbox) if self._toolbox is not None else None
        c = self.config
        if c.messages_column is not None:
            observation: Any = _messages(row, c.messages_column)
            self.messages = list(observation)
        else:
            observation = _prompt(row, c.prompt_column)
            self.messages = [{"role": "user", "content": observation}]
        if c.system_prompt:
            self.messages.insert(0, {"role": "system", "content": c.system_prompt})
        return observation, {}

    async def astep(self, action: Any) -> StepResult:
        row = self._row
        if row is None:
            raise EnvStateError("dataset: step() before reset() or after the episode ended")
        text = str(action)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        if self._toolbox is not None:
            parsed = parse_tool_calls(text)
            if parsed.error is not None:
                return self._go_on(f"Error: {parsed.error}", format_error(parsed.error))
            if parsed.calls:
                return await self._call_tools(parsed.calls)
        self._row = None
        c = self.config
        answer = row.get(c.answer_column) if c.answer_column is not None else None
        reward, parts = await score(
            self.reward,
            c.reward_timeout_s,
            completion=text,
            messages=list(self.messages),
            row=row,
            answer=answer,
            sandbox=self.sandbox,
        )
        info: dict[str, Any] = {"reward_components": parts} if parts else {}
        return "", reward, True, False, info

    async def _call_tools(self, calls: list[Any]) -> StepResult:
        results: list[dict[str, Any]] = []
        for call in calls:
            try:
                method, kwargs = bind_tool_call(self._toolbox, call)
            except ToolCallError as exc:
                results.append({"role": "tool", "content": f"Error: {exc}"})
                return self._go_on(results, format_error(str(exc)))
            output = method(**kwargs)
            output = await output if inspect.isawaitable(output) else output
            results.append({"role": "tool", "content": str(output)})
        return self._go_on(results, {})

    def _go_on(self, observation: Any, info: dict[str, Any]) -> StepResult:
        """An intermediate turn: reward 0; cut (truncated) after `max_turns` replies."""
        messages = (
            observation
            if isinstance(observation, list)
            else [{"role": "user", "content": observation}]
        )
        self.messages.extend(messages)
        if self.turns >= self.config.max_turns:
            self._row = None
            return observation, 0.0, False, True, {**info, "truncated_by": "max_turns"}
        return observation, 0.0, False, False, info


def _load_tools(target: str) -> Any:
    """The tools factory `target` names; it is called per episode (with ``row=`` if it takes one)."""
    module_name, sep, attribute = target.partition(":")
    if not sep:
        raise EnvSpecError(f"tools {target!r}: give pkg.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise EnvSpecError(f"tools {target!r} could not be loaded: {exc}") from exc
    try:
        takes_row = "row" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_row = False
    return lambda row: factory(row=row) if takes_row else factory()


@spec_config(DatasetEnvConfig)
def make_dataset_env(sandbox: SandboxPool | None = None, **kwargs: Any) -> DatasetEnv:
    """Registry factory for ``dataset@{...}``; kwargs are DatasetEnvConfig fields."""
    return DatasetEnv(DatasetEnvConfig(**kwargs), sandbox)
