"""Wrappers: horizon limits, observation formatting, episode tracking, tool-call caps.

Every wrapper drives its inner environment through ``envs.areset``/``envs.astep``,
so it wraps sync, async and Gymnasium-shaped environments alike, and passes the
optional attributes (``system_prompt``, ``tools``, ``action_vocabulary``) through.
A limit that cuts an episode short sets ``truncated=True`` (never ``terminated``)
and names itself in ``info["truncated_by"]``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import pydantic

from envs.api import ResetResult, StepResult, aclose, areset, astep
from envs.parsing import parse_tool_calls


class Wrapper:
    """Base wrapper: forwards everything to ``env``."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not yet set: avoid recursing through __getattr__
            raise AttributeError(name)
        return getattr(self.env, name)

    @property
    def unwrapped(self) -> Any:
        return self.env.unwrapped if isinstance(self.env, Wrapper) else self.env

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        return await areset(self.env, seed=seed, options=options)

    async def astep(self, action: Any) -> StepResult:
        return await astep(self.env, action)

    async def aclose(self) -> None:
        await aclose(self.env)


class HorizonSchedule(pydantic.BaseModel):
    """A rising turn limit: ``min(maximum, start + increment * (training_step // every))``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    start: int = pydantic.Field(ge=1, description="turn limit at training step 0")
    increment: int = pydantic.Field(1, ge=0, description="turns added at each stage")
    every: int = pydantic.Field(ge=1, description="training steps per stage (K)")
    maximum: int = pydantic.Field(ge=1, description="the limit never grows past this")

    def limit(self, training_step: int) -> int:
        staged = self.start + self.increment * (max(0, training_step) // self.every)
        return max(1, min(self.maximum, staged))


class MaxTurns(Wrapper):
    """Truncate an episode after a fixed or scheduled number of turns."""

    def __init__(self, env: Any, limit: int | HorizonSchedule, training_step: int = 0) -> None:
        super().__init__(env)
        if isinstance(limit, int) and limit < 1:
            raise ValueError("max turns must be >= 1")
        self.schedule = limit
        self.training_step = training_step
        self.turns = 0

    @property
    def max_turns(self) -> int:
        if isinstance(self.schedule, HorizonSchedule):
            return self.schedule.limit(self.training_step)
        return self.schedule

    def set_training_step(self, training_step: int) -> None:
        """Move along the schedule; takes effect at the next reset."""
        self.training_step = training_step

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        self.turns = 0
        self._episode_limit = self.max_turns
        return await super().areset(seed, options)

    async def astep(self, action: Any) -> StepResult:
        obs, reward, terminated, truncated, info = await super().astep(action)
        self.turns += 1
        limit = getattr(self, "_episode_limit", self.max_turns)
        info["max_turns"] = limit
        if not terminated and not truncated and self.turns >= limit:
            truncated = True
            info["truncated_by"] = "max_turns"
        return obs, reward, terminated, truncated, info


class ObservationFormat(Wrapper):
    """Show the latest observation only, or the whole history of observations and actions."""

    def __init__(
        self,
        env: Any,
        mode: Literal["latest", "history"] = "latest",
        *,
        action_prefix: str = "Action: ",
        observation_prefix: str = "Observation: ",
        max_chars: int | None = None,
    ) -> None:
        super().__init__(env)
        if mode not in ("latest", "history"):
            raise ValueError(f"observation mode must be 'latest' or 'history', got {mode!r}")
        self.mode = mode
        self.action_prefix = action_prefix
        self.observation_prefix = observation_prefix
        self.max_chars = max_chars
        self._parts: list[str] = []

    def _render(self, obs: Any) -> Any:
        if self.mode == "latest":
            return obs if self.max_chars is None else str(obs)[-self.max_chars :]
        text = "\n".join(self._parts)
        return text if self.max_chars is None else text[-self.max_chars :]

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        obs, info = await super().areset(seed, options)
        self._parts = [f"{self.observation_prefix}{obs}"]
        return self._render(obs), info

    async def astep(self, action: Any) -> StepResult:
        obs, reward, terminated, truncated, info = await super().astep(action)
        self._parts += [f"{self.action_prefix}{action}", f"{self.observation_prefix}{obs}"]
        return self._render(obs), reward, terminated, truncated, info


class EpisodeTracker(Wrapper):
    """Report the step count and the cumulative reward in every step's info."""

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        self.steps, self.episode_return = 0, 0.0
        obs, info = await super().areset(seed, options)
        info.update(episode_steps=0, episode_return=0.0)
        return obs, info

    async def astep(self, action: Any) -> StepResult:
        obs, reward, terminated, truncated, info = await super().astep(action)
        self.steps += 1
        self.episode_return += reward
        info.update(episode_steps=self.steps, episode_return=self.episode_return)
        if terminated or truncated:
            info["episode_done"] = True
        return obs, reward, terminated, truncated, info


class ToolCallLimit(Wrapper):
    """Cap the tool calls per episode and catch the same call made over and over.

    Past ``max_calls`` the episode is truncated (``truncated_by="tool_calls"``). A call
    identical (name and arguments) to one made ``max_repeats`` times already is not
    forwarded: with ``on_repeat="truncate"`` the episode ends
    (``truncated_by="repeated_tool_call"``), with ``"warn"`` the model is told and
    the episode goes on.
    """

    def __init__(
        self,
        env: Any,
        max_calls: int,
        max_repeats: int = 2,
        on_repeat: Literal["truncate", "warn"] = "truncate",
    ) -> None:
        super().__init__(env)
        if max_calls < 1 or max_repeats < 1 or on_repeat not in ("truncate", "warn"):
            raise ValueError("need max_calls >= 1, max_repeats >= 1, on_repeat truncate|warn")
        self.max_calls, self.max_repeats, self.on_repeat = max_calls, max_repeats, on_repeat
        self.calls = 0
        self._seen: Counter[str] = Counter()

    async def areset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        self.calls, self._seen = 0, Counter()
        return await super().areset(seed, options)

    async def astep(self, action: Any) -> StepResult:
        parsed = parse_tool_calls(action)
        repeated = [c.name for c in parsed.calls if self._seen[c.key()] >= self.max_repeats]
        info: dict[str, Any] = {"tool_calls": self.calls}
        if repeated:
            info["repeated_tool_call"] = repeated[0]
            text = f"Error: repeated identical call to {repeated[0]}; try something else."
            if self.on_repeat == "truncate":
                return text, 0.0, False, True, {**info, "truncated_by": "repeated_tool_call"}
            return text, 0.0, False, False, info
        if self.calls + len(parsed.calls) > self.max_calls:
            info["truncated_by"] = "tool_calls"
            return f"Error: tool call limit ({self.max_calls}) reached.", 0.0, False, True, info
        self.calls += len(parsed.calls)
        self._seen.update(c.key() for c in parsed.calls)
        obs, reward, terminated, truncated, inner_info = await super().astep(action)
        return obs, reward, terminated, truncated, {**inner_info, "tool_calls": self.calls}
