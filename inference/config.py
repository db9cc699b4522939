"""Configuration of the CPU policy server (CLI/env/TOML) and of the generation and weight-sync clients.

`ServerConfig` is the role config of `python -m inference`, resolved by `launch.settings`
with precedence CLI flags > `FARM_INFERENCE_*` environment variables > a TOML file given
with `--config` (keys at top level or under `[inference]`). `ClientConfig` and
`WeightSyncConfig` are component configs that the worker and learner roles nest. This
module imports no torch, so `--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from inference.errors import ConfigError
from launch.settings import LogLevel, RoleConfig

# vLLM 0.33's `MaxLoRARanks`: the values `--max-lora-rank` accepts.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerConfig(RoleConfig):
    """Settings of `python -m inference`."""

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)
    role: ClassVar[str] = "inference"
    env_prefix: ClassVar[str] = "FARM_INFERENCE_"
    toml_table: ClassVar[str | None] = "inference"
    error: ClassVar[type[Exception]] = ConfigError

    model: Path = Field(description="Hugging Face model directory (weights, config, tokenizer)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 = any free port)")
    api_key: SecretStr | None = Field(
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
    kv_cache_mb: float = Field(
        512.0,
        ge=0,
        description="memory budget of the prefix cache of KV blocks shared across requests, "
        "in MiB (least recently used blocks evicted; 0 disables it)",
    )
    max_n: int = Field(64, ge=1, le=1024, description="largest accepted `n` per request")
    torch_threads: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads (default: min(4, CPU count))"
    )
    weight_transfer_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="limit on forming the weight-transfer group and on each tensor's broadcast",
    )
    enable_lora: bool = Field(
        False,
        description="serve LoRA adapters: the /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "routes, and adapter names as `model` (vLLM: --enable-lora with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    max_loras: int = Field(
        1, ge=1, le=1024, description="most distinct LoRA adapters in one batch (vLLM's default 1)"
    )
    max_lora_rank: int = Field(
        16, description=f"largest adapter rank accepted, one of {MAX_LORA_RANKS} (as vLLM)"
    )
    log_level: LogLevel = Field("INFO", description="log level")

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in MAX_LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS} (vLLM's choices)")
        return value


def load_server_config(cli: dict[str, Any], toml_path: Path | None = None) -> ServerConfig:
    """Resolve ServerConfig from CLI values (None = unset), the environment and a TOML file."""
    return ServerConfig.load(cli, toml_path)


class ClientConfig(BaseModel):
    """Settings of the generation client (one per worker process)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: SecretStr | None = Field(None, description="bearer token sent to the servers")
    served_model_name: str | None = Field(
        None, description="`model` field of requests (None: the server's default)"
    )
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
    api_key: SecretStr | None = Field(None, description="bearer token sent to the servers")
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
