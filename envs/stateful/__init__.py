"""The ``stateful`` environments: EnvScaler-style state classes played through scenarios."""

from envs.stateful.base import StatefulEnv
from envs.stateful.env import (
    Check,
    Scenario,
    StatefulConfig,
    StatefulScenarioEnv,
    make_stateful_env,
)
from envs.stateful.library import CLASSES

__all__ = [
    "CLASSES",
    "Check",
    "Scenario",
    "StatefulConfig",
    "StatefulEnv",
    "StatefulScenarioEnv",
    "make_stateful_env",
]
