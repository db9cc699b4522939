"""``StatefulEnv``: an EnvScaler-style environment whose attributes are its state.

A subclass lists its state attributes in ``STATE_FIELDS`` and exposes methods as
``@tool``s that read and change them. A scenario supplies the initial state, the
task text and check expressions over the final state. The agent works with the
tools and calls ``finish`` (or runs out of turns: truncated); the final state is
then judged by the scenario's checks, which run in the sandbox, and the reward is
the fraction of checks that hold.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from envs.toolenv import ToolEnv
from envs.tools import tool


class StatefulEnv(ToolEnv):
    """Base class: tools mutate the attributes named in ``STATE_FIELDS``."""

    STATE_FIELDS: tuple[str, ...] = ()

    def load_state(self, state: dict[str, Any]) -> None:
        """Set the state attributes from a scenario's initial state (deep-copied)."""
        unknown = set(state) - set(self.STATE_FIELDS)
        missing = set(self.STATE_FIELDS) - set(state)
        if unknown or missing:
            raise ValueError(
                f"{type(self).__name__} state: unknown {sorted(unknown)}, missing {sorted(missing)}"
            )
        for name, value in copy.deepcopy(state).items():
            setattr(self, name, value)

    def setup(self, seed: int | None) -> tuple[str, dict[str, Any]]:
        """The state is loaded by ``load_state`` before reset; nothing else to draw."""
        return "", {}

    def state_dict(self) -> dict[str, Any]:
        """The current state as plain JSON-able data."""
        return json.loads(json.dumps({name: getattr(self, name) for name in self.STATE_FIELDS}))

    @tool
    def finish(self) -> str:
        """Declare the task complete; the final state is then checked."""
        self.end_episode(0.0)  # the reward comes from the checks, after the step
        return "Finished."
