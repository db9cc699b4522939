"""What `python -m broker` (and `python -m farm.show`, which reads the same run) is
configured with, and how its stream arguments name a run's streams."""

from __future__ import annotations

import argparse
from typing import ClassVar

from pydantic import Field

from broker.connection import DEFAULT_REDIS_URL, RedisUrl
from broker.errors import BrokerError
from broker.keys import RunKeys
from broker.run import Partitions, RunName
from launch.settings import LogLevel, RoleConfig


class BrokerCliConfig(RoleConfig):
    """Where `python -m broker` finds the run."""

    role: ClassVar[str] = "broker"
    error: ClassVar[type[Exception]] = BrokerError

    redis_url: RedisUrl = Field(DEFAULT_REDIS_URL, description="Redis URL")
    run: RunName = Field("demo", description="run name")
    redis_ca_file: str | None = Field(None, description="CA bundle for rediss:// URLs")
    partitions: Partitions = Field(1, description="trajectory partitions of the run")
    redis_wait: float = Field(10.0, gt=0.0, description="seconds to keep retrying Redis")
    log_level: LogLevel = Field("WARNING", description="log level")


def resolve_stream(keys: RunKeys, name: str) -> str:
    """The key a stream argument names: a full key, `policy`, or `tasks`/`trajectories`/
    `deadletter` with an optional `:PARTITION`."""
    if name.startswith("{"):
        return name
    if name == "policy":
        return keys.policy_events
    base, _, part = name.partition(":")  # `tasks:2`: partition 2's tasks stream
    if base in ("tasks", "trajectories", "deadletter") and (part.isdigit() or not part):
        p = int(part or 0)
        wide = RunKeys(keys.run, max(keys.partitions, p + 1))
        if base == "tasks":
            return wide.task_stream(p)
        return wide.trajectories(p) if base == "trajectories" else wide.deadletter_of(p)
    raise argparse.ArgumentTypeError(f"unknown stream {name!r}")
