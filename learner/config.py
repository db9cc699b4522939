"""The learner's configuration: one pydantic-settings model, loaded CLI > env > TOML.

`LearnerConfig` holds every knob of `python -m learner`; each field has a
description and bounds, and unknown keys are rejected wherever they come from
(TOML file, keyword arguments). `FARM_*` environment variables fill fields the
command line left out, and a TOML file given with `--config` fills the rest.
This module imports neither torch nor transformers, so `--help` is instant.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    SettingsConfigDict,
)

from broker.settings import CommaList, RedisUrl, SettingsError, resolve_settings
from learner.errors import ConfigError


class Algorithm(enum.StrEnum):
    """Advantage estimator."""

    GRPO = "grpo"
    REBN = "rebn"
    RLOO = "rloo"
    REINFORCE = "reinforce"


class Aggregation(enum.StrEnum):
    """How per-token losses become one number."""

    TOKEN_MEAN = "token-mean"  # every completion token of the batch weighs the same
    SEQ_MEAN = "seq-mean"  # every sequence weighs the same, tokens averaged within it


class StalePolicy(enum.StrEnum):
    """What to do with a group older than `max_staleness` (counted either way)."""

    CORRECT = "correct"  # train it with truncated importance sampling
    DROP = "drop"  # do not train it


class Precision(enum.StrEnum):
    AUTO = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    FP32 = "fp32"
    BF16 = "bf16"  # autocast; only on CUDA


class LearnerConfig(BaseSettings):
    """Everything `python -m learner` needs; see docs/learner.md for the reference."""

    model_config = SettingsConfigDict(env_prefix="FARM_", extra="forbid", validate_default=True)

    # --- model, run, Redis, inference -------------------------------------------------------
    model: Path = Field(description="Hugging Face model directory (weights, config, tokenizer)")
    run: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="run name")
    redis_url: RedisUrl = Field("redis://127.0.0.1:6379/0", description="Redis URL")
    inference_urls: CommaList = Field(
        default_factory=list, description="inference servers to push weights to (comma-separated)"
    )
    inference_api_key: str | None = Field(None, description="bearer token for the servers")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port (0: none)")
    partitions: int = Field(1, ge=1, le=256, description="trajectories stream partitions")
    consumer_name: str = Field("learner", min_length=1, description="consumer name in the group")
    # --- algorithm ----------------------------------------------------------------------------
    algorithm: Algorithm = Field(Algorithm.GRPO, description="advantage estimator")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount gamma for per-turn returns")
    groups_per_batch: int = Field(8, ge=1, le=100_000, description="groups per optimizer step")
    group_size: int = Field(8, ge=1, le=4096, description="episodes per task (group)")
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward pass")
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range below 1")
    clip_high: float = Field(0.2, gt=0.0, le=10.0, description="PPO clip range above 1")
    aggregation: Aggregation = Field(Aggregation.TOKEN_MEAN, description="loss aggregation")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping norm")
    skip_zero_variance: bool = Field(True, description="skip groups whose returns are all equal")
    # --- staleness ----------------------------------------------------------------------------
    max_staleness: int = Field(1, ge=0, le=1000, description="policy versions a group may lag")
    stale_policy: StalePolicy = Field(StalePolicy.CORRECT, description="stragglers: correct|drop")
    tis_cap: float = Field(2.0, ge=1.0, description="truncation rho_bar of importance weights")
    # --- checkpoints, device, steps -----------------------------------------------------------
    checkpoint_dir: Path | None = Field(None, description="where checkpoints go (None: none)")
    checkpoint_interval: int = Field(10, ge=1, description="steps between checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    resume: bool = Field(False, description="continue from the latest checkpoint")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="torch device")
    precision: Precision = Field(Precision.AUTO, description="auto|fp32|bf16")
    max_steps: int = Field(0, ge=0, description="stop after this many steps (0: never)")
    seed: int = Field(0, ge=0, description="seed for torch and the task sampler")
    # --- weight push --------------------------------------------------------------------------
    push_interval: int = Field(1, ge=0, description="push weights every K steps (0: never)")
    weights_dir: Path | None = Field(None, description="where pushed weights are written")
    # --- task source --------------------------------------------------------------------------
    tasks: Path | None = Field(None, description="JSONL dataset of env specs (None: no feeding)")
    env_modules: CommaList = Field(
        default_factory=list,
        description="modules imported at start-up to register extra environments (as workers')",
    )
    max_failed_batches: int = Field(
        10, ge=0, description="stop after this many batches in a row spoiled by infra/spec errors"
    )
    curriculum: bool = Field(False, description="move difficulty by recent success rate")
    curriculum_window: int = Field(32, ge=1, description="episodes in the success-rate window")
    promote_above: float = Field(0.8, ge=0.0, le=1.0, description="success rate to go harder")
    demote_below: float = Field(0.2, ge=0.0, le=1.0, description="success rate to go easier")
    success_threshold: float = Field(0.5, description="episode return counted as a success")
    horizon_start: int | None = Field(None, ge=1, description="first max-turns horizon")
    horizon_max: int | None = Field(None, ge=1, description="last max-turns horizon")
    horizon_every: int = Field(10, ge=1, description="steps between horizon increments")
    # --- replay -------------------------------------------------------------------------------
    replay: str | None = Field(None, description="archive path or stream:START..END to train from")
    # --- scale: FSDP, micro-batch layout, logprob chunks (docs/learner.md "Scale") -----------
    max_tokens_per_micro_batch: int = Field(
        0, ge=0, description="token budget per micro-batch, sequences bucketed by length (0: none)"
    )
    packing: bool = Field(
        True, description="pack sequences into one row (the model must honour packed position ids)"
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, le=1_000_000, description="tokens per LM-head chunk of the logprob pass"
    )
    activation_checkpointing: bool = Field(False, description="recompute decoder layers")
    cpu_offload: bool = Field(False, description="FSDP: params, grads, AdamW state on the host")
    # --- consumer -----------------------------------------------------------------------------
    reclaim_idle_s: float = Field(
        3600.0, gt=0.0, description="idle seconds before entries of a dead learner are reclaimed"
    )
    max_deliveries: int = Field(10, ge=1, description="deliveries before a group is dead-lettered")

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.demote_below > self.promote_above:
            raise ValueError("demote_below must not exceed promote_above")
        if (self.horizon_start is None) != (self.horizon_max is None):
            raise ValueError("horizon_start and horizon_max go together")
        if self.horizon_start and self.horizon_max and self.horizon_start > self.horizon_max:
            raise ValueError("horizon_start must not exceed horizon_max")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs checkpoint_dir")
        return self

    @property
    def admission_limit(self) -> int:
        """Tasks (groups) allowed in flight or buffered: (max_staleness + 1) x groups_per_batch."""
        return (self.max_staleness + 1) * self.groups_per_batch

    @classmethod
    def load(cls, cli: dict[str, Any], toml_file: Path | None = None) -> LearnerConfig:
        """Resolve CLI values > FARM_* env > TOML; raise ConfigError with every problem."""
        try:
            return resolve_settings(cls, cli, toml_file, "learner")
        except SettingsError as exc:
            raise ConfigError(str(exc)) from exc
