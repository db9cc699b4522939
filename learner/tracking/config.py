"""The trackers' config: which experiment trackers the learner writes to, and where.

`TrackingConfig` is one section of `LearnerConfig` (``[tracking]`` in TOML). Its fields are
flags by their flat names: ``--tracker wandb,tensorboard`` (or the flag repeated),
``--tracker-dir``, ``--tracker-project``, ``--tracker-run-name``,
``--tracker-sample-interval``, ``--tracker-sample-rows``, ``--tracker-wandb-mode``. Nothing
here imports wandb or tensorboard: the backends are imported only when named.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass
from pydantic_settings import NoDecode

from launch.settings import split_commas


class TrackerKind(enum.StrEnum):
    """An experiment tracker backend."""

    WANDB = "wandb"  # Weights & Biases (offline unless a key is found)
    TENSORBOARD = "tensorboard"  # TensorBoard event files


class WandbMode(enum.StrEnum):
    """How the W&B run talks to the server."""

    AUTO = "auto"  # WANDB_MODE if set, else online with an API key and offline without one
    ONLINE = "online"
    OFFLINE = "offline"  # written to disk only; `wandb sync DIR` uploads it later


def _none_is_empty(value: Any) -> Any:
    items = split_commas(value)
    if isinstance(items, list) and "none" in items:
        if len(items) > 1:
            raise ValueError("'none' cannot be combined with a tracker")
        return []
    return items


# "wandb,tensorboard" from a flag or variable, a list in TOML; "none" is the empty list
TrackerList = Annotated[list[TrackerKind], NoDecode, BeforeValidator(_none_is_empty)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TrackingConfig:
    """Experiment trackers (W&B, TensorBoard): step records, config and sample tables."""

    tracker: TrackerList = Field(
        default_factory=list,
        description="wandb|tensorboard|none, comma-separated",
    )
    tracker_dir: Path = Field(
        Path("runs"), description="tracker files: DIR/tensorboard/RUN and DIR/wandb/*-run-*"
    )
    tracker_project: str = Field(
        "rollout-farm", min_length=1, max_length=128, description="W&B project"
    )
    tracker_run_name: str | None = Field(
        None, min_length=1, max_length=128, description="tracker run name (None: the run)"
    )
    tracker_sample_interval: int = Field(
        10, ge=0, description="log a table of sample trajectories every N steps (0: never)"
    )
    tracker_sample_rows: int = Field(
        4, ge=1, le=256, description="trajectories in each sample table"
    )
    tracker_wandb_mode: WandbMode = Field(
        WandbMode.AUTO, description="auto|online|offline (auto: offline without an API key)"
    )

    @field_validator("tracker")
    @classmethod
    def _distinct(cls, value: list[TrackerKind]) -> list[TrackerKind]:
        return list(dict.fromkeys(value))
