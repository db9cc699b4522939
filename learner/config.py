"""The learner's configuration: one role model nesting its components' config models.

`LearnerConfig` holds every knob of `python -m learner`. Its sections are the
config models the components take as they are: `OptimConfig` (the trainer),
`BatchRules` (batch preparation), `CurriculumRules` (the task sampler) and
`HorizonSchedule` (the task feeder). Every field has a description and bounds, and
is a flag, a ``FARM_*`` variable and a TOML key by its flat name (``--learning-rate``,
``FARM_LEARNING_RATE``, ``learning_rate`` or ``[optim] learning_rate``), resolved by
`launch.settings` (flags > environment > TOML). Unknown keys are rejected. This
module imports neither torch nor transformers, so `--help` is instant.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict, Field, SecretStr, model_validator
from pydantic.dataclasses import dataclass

from broker.connection import RedisUrl
from broker.consumer import ConsumerSettings
from launch.settings import CommaList, LogLevel, RoleConfig, section
from learner.errors import ConfigError

COMPONENT = ConfigDict(extra="forbid")


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
    """Numeric precision of the forward and backward passes."""

    AUTO = "auto"  # bf16 autocast on CUDA, fp32 on CPU
    FP32 = "fp32"
    BF16 = "bf16"  # autocast; only on CUDA


@dataclass(frozen=True, config=COMPONENT)
class OptimConfig:
    """Optimizer and loss: the trainer's config."""

    learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range below 1")
    clip_high: float = Field(0.2, gt=0.0, le=10.0, description="PPO clip range above 1")
    tis_cap: float = Field(2.0, ge=1.0, description="truncation rho_bar of importance weights")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping norm")
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward pass")
    aggregation: Aggregation = Field(Aggregation.TOKEN_MEAN, description="loss aggregation")
    precision: Precision = Field(Precision.AUTO, description="auto|fp32|bf16")

    def bf16(self, device_type: str) -> bool:
        """Whether to autocast to bf16 on a device of this type."""
        if self.precision is Precision.AUTO:
            return device_type == "cuda"
        return self.precision is Precision.BF16


@dataclass(frozen=True, config=COMPONENT)
class BatchRules:
    """Advantages and staleness: what a batch trains."""

    algorithm: Algorithm = Field(Algorithm.GRPO, description="advantage estimator")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount gamma for per-turn returns")
    max_staleness: int = Field(1, ge=0, le=1000, description="policy versions a group may lag")
    stale_policy: StalePolicy = Field(StalePolicy.CORRECT, description="stragglers: correct|drop")
    skip_zero_variance: bool = Field(True, description="skip groups whose returns are all equal")

    @property
    def drop_stale(self) -> bool:
        return self.stale_policy is StalePolicy.DROP


@dataclass(frozen=True, config=COMPONENT)
class CurriculumRules:
    """Difficulty curriculum: the task sampler's config."""

    curriculum: bool = Field(False, description="move difficulty by recent success rate")
    curriculum_window: int = Field(32, ge=1, description="episodes in the success-rate window")
    promote_above: float = Field(0.8, ge=0.0, le=1.0, description="success rate to go harder")
    demote_below: float = Field(0.2, ge=0.0, le=1.0, description="success rate to go easier")
    success_threshold: float = Field(0.5, description="episode return counted as a success")

    @model_validator(mode="after")
    def _ordered(self) -> CurriculumRules:
        if self.demote_below > self.promote_above:
            raise ValueError("demote_below must not exceed promote_above")
        return self


@dataclass(frozen=True, config=COMPONENT)
class HorizonSchedule:
    """Rising horizon: max turns from horizon_start up by one every horizon_every steps."""

    horizon_start: int | None = Field(None, ge=1, description="first max-turns horizon")
    horizon_max: int | None = Field(None, ge=1, description="last max-turns horizon")
    horizon_every: int = Field(10, ge=1, description="steps between horizon increments")

    @model_validator(mode="after")
    def _ordered(self) -> HorizonSchedule:
        if (self.horizon_start is None) != (self.horizon_max is None):
            raise ValueError("horizon_start and horizon_max go together")
        if self.horizon_start and self.horizon_max and self.horizon_start > self.horizon_max:
            raise ValueError("horizon_start must not exceed horizon_max")
        return self

    def at(self, step: int) -> int | None:
        """The horizon of tasks issued at learner step `step` (None: schedule off)."""
        if self.horizon_start is None or self.horizon_max is None:
            return None
        return min(self.horizon_max, self.horizon_start + step // self.horizon_every)


class LearnerConfig(RoleConfig):
    """Everything `python -m learner` needs; see docs/learner.md for the reference."""

    role: ClassVar[str] = "learner"
    error: ClassVar[type[Exception]] = ConfigError

    # --- model, run, Redis, inference -------------------------------------------------------
    model: Path = Field(description="Hugging Face model directory (weights, config, tokenizer)")
    run: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="run name")
    redis_url: RedisUrl = Field("redis://127.0.0.1:6379/0", description="Redis URL")
    inference_urls: CommaList = Field(
        default_factory=list, description="inference servers to push weights to (comma-separated)"
    )
    inference_api_key: SecretStr | None = Field(None, description="bearer token for the servers")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port (0: none)")
    log_level: LogLevel = Field("INFO", description="log level")
    partitions: int = Field(1, ge=1, le=256, description="trajectories stream partitions")
    consumer_name: str = Field("learner", min_length=1, description="consumer name in the group")
    # --- batches ------------------------------------------------------------------------------
    groups_per_batch: int = Field(8, ge=1, le=100_000, description="groups per optimizer step")
    group_size: int = Field(8, ge=1, le=4096, description="episodes per task (group)")
    # --- checkpoints, device, steps -----------------------------------------------------------
    checkpoint_dir: Path | None = Field(None, description="where checkpoints go (None: none)")
    checkpoint_interval: int = Field(10, ge=1, description="steps between checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    resume: bool = Field(False, description="continue from the latest checkpoint")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="torch device")
    max_steps: int = Field(0, ge=0, description="stop after this many steps (0: never)")
    seed: int = Field(0, ge=0, description="seed for torch and the task sampler")
    # --- weight push --------------------------------------------------------------------------
    push_interval: int = Field(1, ge=0, description="push weights every K steps (0: never)")
    weights_dir: Path | None = Field(None, description="where pushed weights are written")
    # --- task source and replay ---------------------------------------------------------------
    tasks: Path | None = Field(None, description="JSONL dataset of env specs (None: no feeding)")
    env_modules: CommaList = Field(
        default_factory=list,
        description="modules imported at start-up to register extra environments (as workers')",
    )
    max_failed_batches: int = Field(
        10, ge=0, description="stop after this many batches in a row spoiled by infra/spec errors"
    )
    replay: str | None = Field(None, description="archive path or stream:START..END to train from")
    # --- consumer -----------------------------------------------------------------------------
    consumer: ConsumerSettings = section(
        ConsumerSettings, reclaim_idle_s=3600.0, max_deliveries=10
    )  # a dead learner's groups wait long: its own stay pending until a checkpoint holds them
    # --- components ---------------------------------------------------------------------------
    optim: OptimConfig = section(OptimConfig)
    batch: BatchRules = section(BatchRules)
    curriculum: CurriculumRules = section(CurriculumRules)
    horizon: HorizonSchedule = section(HorizonSchedule)

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs checkpoint_dir")
        return self

    @property
    def admission_limit(self) -> int:
        """Tasks (groups) allowed in flight or buffered: (max_staleness + 1) x groups_per_batch."""
        return (self.batch.max_staleness + 1) * self.groups_per_batch
