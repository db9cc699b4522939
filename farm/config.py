"""The one-machine farm's configuration: one role model, CLI > env > TOML.

`FarmConfig` (resolved by `launch.settings`, like every role's) holds what `farm up`
and `farm demo` need to build the stack: where
Redis and the inference servers are (started locally when not given), how many
workers, what the learner trains on and for how long, where the run's files
go, and (the `gpu` section, `farm.gpus`) which GPUs the vLLM servers and the learner's
ranks run on. Flags given on the command line win, then `FARM_*` environment variables, then
a TOML file given with `--config`. Unknown keys are rejected everywhere. This module
imports neither torch nor transformers, so `farm --help` answers at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator

from broker.bounds import StreamBounds
from broker.connection import RedisUrl
from broker.run import RunFields
from farm.errors import ConfigError
from farm.gpus import GpuSettings
from farm.monitor import MonitorSettings
from launch.settings import CommaList, RoleConfig, section
from learner.dataspec import DataConfig
from learner.progress import ProgressRules


class FarmConfig(RunFields, RoleConfig):
    """Everything the local stack needs; see docs/farm.md."""

    role: ClassVar[str] = "farm"
    error: ClassVar[type[Exception]] = ConfigError

    redis_url: RedisUrl | None = Field(
        None, description="Redis to use; None starts a private redis-server (AOF on)"
    )
    redis_port: int = Field(0, ge=0, le=65535, description="port of the private Redis (0: free)")
    inference_urls: CommaList = Field(
        default_factory=list,
        description="inference servers (comma-separated); empty starts them (--inference)",
    )
    inference_port: int = Field(
        0, ge=0, le=65535, description="first inference server's port, +1 per server (0: free)"
    )
    model: Path | None = Field(
        None,
        description="Hugging Face model directory (farm demo also takes the name smollm2); "
        "None builds the tiny model in work_dir",
    )
    workers: int = Field(2, ge=0, le=256, description="worker processes")
    worker_concurrency: int | None = Field(
        None, ge=1, le=100_000, description="tasks each worker runs at once (None: its default)"
    )
    sandbox_backend: str | None = Field(
        None, pattern=r"^(docker|bwrap)$", description="workers' sandbox backend (None: default)"
    )
    env_spec: str = Field(
        'toy@{"difficulty": 0}',
        min_length=1,
        description="environment the tasks use",
        json_schema_extra={"flag_aliases": ["env"]},
    )
    tasks: Path | None = Field(
        None,
        description="learner's task dataset (JSONL, Parquet or a datasets directory); "
        "None writes one line with env_spec",
    )
    max_steps: int = Field(0, ge=0, description="learner steps before the farm stops (0: never)")
    learner_args: list[str] = Field(
        default_factory=list,
        description="extra flag passed to `python -m learner`",
        json_schema_extra={"flag": "learner-arg"},
    )
    worker_args: list[str] = Field(
        default_factory=list,
        description="extra flag passed to each `python -m workers`",
        json_schema_extra={"flag": "worker-arg"},
    )
    work_dir: Path = Field(Path(".farm"), description="run directory: model, Redis, logs")
    metrics_port: int = Field(9400, ge=0, le=65535, description="supervisor /metrics (0: none)")
    status_interval_s: float = Field(5.0, gt=0.0, le=3600.0, description="status refresh period")
    restart_max: int = Field(5, ge=0, le=1000, description="crashes per child within 5 min")
    archive: Path | None = Field(
        None,
        description="run the archiver: the trajectories stream into segments here, "
        "for `python -m learner --replay`",
    )
    gpu: GpuSettings = section(GpuSettings)  # vLLM servers and learner ranks (farm.gpus)
    monitor: MonitorSettings = section(MonitorSettings)  # --monitor: Prometheus (farm.monitor)
    streams: StreamBounds = section(StreamBounds, prefix="stream_")  # retention: the learner's
    data: DataConfig = section(DataConfig)  # --prompt-column, --reward, ...: for the learner
    progress: ProgressRules = section(ProgressRules)  # --stop-when-solved, ...: for the learner

    @field_validator("inference_urls")
    @classmethod
    def _no_trailing_slash(cls, value: list[str]) -> list[str]:
        return [u.rstrip("/") for u in value]

    @field_validator("env_spec")
    @classmethod
    def _env_spec_shape(cls, value: str) -> str:
        name, _, kwargs = value.partition("@")
        if not name or (kwargs and not isinstance(_json_object(kwargs), dict)):
            raise ValueError(f"expected name@{{json object}}, got {value!r}")
        return value


def _json_object(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def load_config(toml: Path | None = None, **cli: Any) -> FarmConfig:
    """Resolve CLI values > FARM_* env > TOML; flags left as None fall through."""
    return FarmConfig.load(cli, toml)
