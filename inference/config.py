"""Configuration of the CPU policy server (CLI/env/TOML) and of the generation and weight-sync clients.

`ServerConfig` resolves with precedence CLI flags > `FARM_INFERENCE_*` environment variables >
a TOML file given with `--config`. This module imports no torch, so `--help` is instant.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict


class ServerConfig(BaseSettings):
    """Settings of `python -m inference`."""

    model_config = SettingsConfigDict(env_prefix="FARM_INFERENCE_", extra="forbid", frozen=True)

    model: Path = Field(description="Hugging Face model directory (weights, config, tokenizer)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 = any free port)")
    api_key: str | None = Field(
        None, description="bearer token required on every route except /health and /metrics"
    )
    weight_version: str = Field(
        "0", min_length=1, description="label of the weights loaded at start"
    )
    served_model_name: str | None = Field(
        None,
        description="name reported by /v1/models and in responses (default: the directory name)",
    )
    max_batch_size: int = Field(64, ge=1, le=4096, description="most sequences in one forward pass")
    batch_window_ms: float = Field(
        3.0,
        ge=0,
        le=1000,
        description="how long an idle engine waits to collect concurrent requests",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="context limit (default: the model's max_position_embeddings)"
    )
    max_n: int = Field(64, ge=1, le=1024, description="largest accepted `n` per request")
    torch_threads: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads (default: min(4, CPU count))"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level")


def load_server_config(cli: dict[str, Any], toml_path: Path | None = None) -> ServerConfig:
    """Resolve ServerConfig from CLI values (None = unset), the environment and an optional TOML file."""
    file_values: dict[str, Any] = {}
    if toml_path is not None:
        with open(toml_path, "rb") as fh:
            file_values = tomllib.load(fh)
        file_values = file_values.get("inference", file_values)

    class _Resolved(ServerConfig):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_):  # type: ignore[override]
            return (init_settings, env_settings, InitSettingsSource(settings_cls, file_values))

    resolved = _Resolved(**{k: v for k, v in cli.items() if v is not None})
    return ServerConfig.model_construct(**resolved.model_dump())


class ClientConfig(BaseModel):
    """Settings of the generation client (one per worker process)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: str | None = Field(None, description="bearer token sent to the servers")
    model: str | None = Field(None, description="`model` field of requests (None: server default)")
    request_timeout_s: float = Field(300.0, gt=0, description="limit on one completion call")
    connect_timeout_s: float = Field(5.0, gt=0, description="limit on opening a connection")
    retry_budget_s: float = Field(
        600.0, gt=0, description="total time generate() may spend across retries before giving up"
    )
    backoff_initial_s: float = Field(0.05, gt=0, description="first retry delay")
    backoff_max_s: float = Field(2.0, gt=0, description="largest retry delay")
    health_interval_s: float = Field(2.0, gt=0, description="period of /health checks")
    health_timeout_s: float = Field(2.0, gt=0, description="limit on one /health call")
    max_sessions: int = Field(
        100_000, ge=1, description="sticky session entries kept (least recently used dropped)"
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=65_536,
        description="open HTTP connections across all servers (generations in flight at once)",
    )
    max_abort_resumes: int = Field(
        8,
        ge=0,
        description="times a generation cut by a pause(abort) is continued before returning",
    )


class WeightSyncConfig(BaseModel):
    """Settings of the weight-sync client."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root_dir: Path = Field(description="directory where versioned weight directories are written")
    api_key: str | None = Field(None, description="bearer token sent to the servers")
    pause_mode: Literal["abort", "wait", "keep"] = Field(
        "keep", description="how servers treat in-flight requests during the update"
    )
    timeout_s: float = Field(120.0, gt=0, description="limit on each control call")
    attempts: int = Field(
        3, ge=1, le=100, description="tries per server before reporting it failed"
    )
    backoff_s: float = Field(0.5, ge=0, description="delay between tries")
    keep_versions: int = Field(
        2, ge=1, description="weight directories kept on disk (oldest pruned)"
    )
    server_world_sizes: tuple[int, ...] | None = Field(
        None,
        description="NCCL path: workers (TP x PP x DP) of each server, in URL order; "
        "None asks each server's GET /get_world_size?include_dp=true",
    )
