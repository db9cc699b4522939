"""The settings every role of one run must agree on, declared once.

A run is named by its run name, found in one Redis and laid out over a number of
partitions; its environments come from the same plug-in modules everywhere. Each role
inherits these fields from `RunFields` (the broker's own CLI, which runs no
environment, declares its three with the same types), so the fields, the run-name
pattern, the partition bounds and the default URL are each written once. `RunSection`
holds them as one value for the processes that start other roles (`farm`): it is
rendered to the same flat flags (`--run`, `--redis-url`, `--partitions`,
`--env-modules`, `--log-level`) every role reads, with `launch.settings.render_flags`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from broker.connection import DEFAULT_REDIS_URL, RedisUrl
from broker.keys import MAX_PARTITIONS, RUN_NAME_PATTERN, RunKeys
from launch.settings import CommaList, LogLevel

RunName = Annotated[str, Field(pattern=RUN_NAME_PATTERN)]
Partitions = Annotated[int, Field(ge=1, le=MAX_PARTITIONS)]


class RunFields(BaseModel):
    """The run's fields, declared once: every role of a run (learner, workers, their
    one-off commands, farm) inherits them, so their flags, variables and TOML keys are
    the same everywhere and a field added here reaches every role."""

    run: RunName = Field("demo", description="run name")
    redis_url: RedisUrl = Field(DEFAULT_REDIS_URL, description="Redis URL")
    partitions: Partitions = Field(
        1, description="task/trajectory stream partitions (one slot each on a cluster)"
    )
    env_modules: CommaList = Field(
        default_factory=list,
        description="modules imported at start-up to register extra environments",
    )
    log_level: LogLevel = Field("INFO", description="log level")


class RunSection(RunFields):
    """The run every role of one farm shares, as one value (what `farm` hands its children)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls, config: RunFields, **override: object) -> RunSection:
        """The run fields of a role's config, with `override` (e.g. the Redis a farm started)."""
        return cls.model_validate(
            {name: getattr(config, name) for name in RunFields.model_fields} | override
        )

    def keys(self) -> RunKeys:
        """The run's key names."""
        return RunKeys(self.run, self.partitions)
