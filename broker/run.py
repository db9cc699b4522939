"""The settings every role of one run must agree on, declared once.

A run is named by its run name, found in one Redis and laid out over a number of
partitions; its environments come from the same plug-in modules everywhere. Each role
declares these fields with the types below (`RunName`, `Partitions`, `RedisUrl` and
`DEFAULT_REDIS_URL`), so the run-name pattern, the partition bounds and the default
URL are written once, in `broker.keys` and `broker.connection`. `RunSection` groups
them for the processes that start other roles (`farm`): it is rendered to the same
flat flags (`--run`, `--redis-url`, `--partitions`, `--env-modules`, `--log-level`)
every role reads, with `launch.settings.render_flags`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from broker.connection import DEFAULT_REDIS_URL, RedisUrl
from broker.keys import MAX_PARTITIONS, RUN_NAME_PATTERN, RunKeys
from launch.settings import CommaList, LogLevel

RunName = Annotated[str, Field(pattern=RUN_NAME_PATTERN)]
Partitions = Annotated[int, Field(ge=1, le=MAX_PARTITIONS)]


class RunSection(BaseModel):
    """The run every role of one farm shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run: RunName = Field("demo", description="run name")
    redis_url: RedisUrl = Field(DEFAULT_REDIS_URL, description="Redis URL")
    partitions: Partitions = Field(1, description="task/trajectory stream partitions")
    env_modules: CommaList = Field(
        default_factory=list,
        description="modules imported at start-up to register extra environments",
    )
    log_level: LogLevel = Field("INFO", description="log level")

    def keys(self) -> RunKeys:
        """The run's key names."""
        return RunKeys(self.run, self.partitions)
