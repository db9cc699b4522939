"""The learner's configuration: one role model nesting its components' config models.

`LearnerConfig` holds every knob of `python -m learner`. Its sections are the
config models the components take as they are: `OptimConfig` (the trainer),
`ScaleConfig` (FSDP options, micro-batch layout, logprob chunks: the trainer),
`BatchRules` (batch preparation), `CurriculumRules` (the task sampler),
`HorizonSchedule` (the task feeder), `LossConfig` (loss terms, epochs, critic) and
`TrackingConfig` (experiment trackers, `learner.tracking`). Every
field has a description and bounds, and
is a flag, a ``FARM_*`` variable and a TOML key by its flat name (``--learning-rate``,
``FARM_LEARNING_RATE``, ``learning_rate`` or ``[optim] learning_rate``), resolved by
`launch.settings` (flags > environment > TOML). Unknown keys are rejected. This
module imports neither torch nor transformers, so `--help` is instant.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.dataclasses import dataclass

from broker.bounds import StreamBounds
from broker.consumer import ConsumerSettings
from broker.run import RunFields
from envs.wrappers import HorizonSchedule as TurnSchedule
from launch.settings import CommaList, RoleConfig, section
from learner.collapse import CollapseRules
from learner.dataspec import DataConfig
from learner.errors import ConfigError
from learner.lora import LoraSettings
from learner.progress import ProgressRules
from learner.tracking.config import TrackingConfig

COMPONENT = ConfigDict(extra="forbid")


class Algorithm(enum.StrEnum):
    """Advantage estimator."""

    GRPO = "grpo"
    REBN = "rebn"
    RLOO = "rloo"
    REINFORCE = "reinforce"
    # REINFORCE++: per-turn returns whitened over the batch's completion tokens; "-baseline"
    # subtracts the group's mean episode return first (verl's reinforce_plus_plus[_baseline])
    REINFORCE_PP = "reinforce++"
    REINFORCE_PP_BASELINE = "reinforce++-baseline"
    PPO = "ppo"  # critic PPO: per-token GAE from a learned value function

    @property
    def group_relative(self) -> bool:
        """Whether the baseline comes from the group, so equal returns carry no signal."""
        return self in (Algorithm.GRPO, Algorithm.RLOO, Algorithm.REINFORCE_PP_BASELINE)


class Aggregation(enum.StrEnum):
    """How per-token losses become one number."""

    TOKEN_MEAN = "token-mean"  # every completion token of the batch weighs the same
    SEQ_MEAN = "seq-mean"  # every sequence weighs the same, tokens averaged within it
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # token losses summed, sequences averaged
    # Dr. GRPO's constant normaliser: token losses summed, over sequences x --norm-tokens
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class StalePolicy(enum.StrEnum):
    """What to do with a group older than `max_staleness` (counted either way)."""

    CORRECT = "correct"  # train it with the behaviour correction
    DROP = "drop"  # do not train it


class Correction(enum.StrEnum):
    """Behaviour correction pi_prox/mu applied to every token."""

    TIS = "tis"  # truncated importance sampling: min(w, C)
    # masked importance sampling: w inside [1/C, C], else rejected (out of the loss and its
    # denominator, as verl's rejection sampling)
    MIS = "mis"


class CorrectionLevel(enum.StrEnum):
    """What one behaviour weight w = pi_prox/mu covers."""

    TOKEN = "token"  # each token its own ratio (low variance, biased)
    SEQUENCE = "sequence"  # the product over the sequence's tokens (verl's sequence TIS)
    GEOMETRIC = "geometric"  # the geometric mean over its tokens (prime-rl's sequence mask)


class PolicyRatio(enum.StrEnum):
    """The ratio pi_theta/pi_prox that PPO clips."""

    TOKEN = "token"  # per token (PPO, GRPO, DAPO)
    SEQUENCE = "sequence"  # GSPO: the sequence's geometric-mean ratio, on every token


class KLEstimator(enum.StrEnum):
    """Per-token estimator of KL(pi_theta || pi_ref) (Schulman's k1/k2/k3)."""

    K1 = "k1"  # log r
    K2 = "k2"  # (log r)^2 / 2
    K3 = "k3"  # exp(-log r) + log r - 1, unbiased and non-negative
    # straight-through: the k1 or k3 value with the k2 gradient (the gradient of the true KL)
    K1_ST = "k1+"
    K3_ST = "k3+"


class LrSchedule(enum.StrEnum):
    """The learning rate after the warm-up."""

    CONSTANT = "constant"
    LINEAR = "linear"  # down to min_lr_ratio x lr at lr_decay_steps
    COSINE = "cosine"  # half a cosine down to min_lr_ratio x lr at lr_decay_steps


class KLMode(enum.StrEnum):
    """Where the KL to the reference enters."""

    LOSS = "loss"  # kl_coef * KL added to the loss (GRPO paper, verl use_kl_loss)
    REWARD = "reward"  # kl_coef * KL subtracted from each turn's reward (InstructGPT, verl)


class Overlong(enum.StrEnum):
    """What happens to episodes a length limit cut (DAPO): the context, an agent's token
    budget, or a completion that reached max tokens (`learner.batch.overlong`)."""

    NONE = "none"  # trained like any other
    MASK = "mask"  # overlong filtering: no loss on their tokens (still in the group baseline)
    SOFT = "soft"  # soft linear punishment over the last overlong_buffer tokens


class GroupStd(enum.StrEnum):
    """The std that GRPO divides by."""

    POPULATION = "population"  # sqrt(sum (R - mean)^2 / n)
    UNBIASED = "unbiased"  # sqrt(sum (R - mean)^2 / (n - 1)), as torch.std in verl and TRL


class WeightTransfer(enum.StrEnum):
    """How pushed weights reach the inference servers."""

    FILE = "file"  # safetensors directories every server reloads (shared or local disk)
    NCCL = "nccl"  # vLLM 0.33's weight-transfer routes: broadcast from the learner, no files


class TransferBackend(enum.StrEnum):
    """The collective that carries an NCCL-route transfer."""

    NCCL = "nccl"  # vLLM's trainer_init (CUDA and vLLM on the learner)
    GLOO = "gloo"  # CPU: the CPU policy server's stand-in for NCCL (tests, CPU farms)


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
    tis_cap: float = Field(2.0, ge=1.0, description="C: TIS cap, MIS band [1/C, C]")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping norm")
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward/backward pass")
    aggregation: Aggregation | None = Field(
        None,
        description="loss aggregation (default: token-mean; seq-mean with --policy-ratio "
        "sequence, GSPO's seq-mean-token-mean)",
    )
    norm_tokens: int | None = Field(
        None, ge=1, description="L of seq-mean-token-sum-norm (Dr. GRPO: the max response length)"
    )
    precision: Precision = Field(Precision.AUTO, description="auto|fp32|bf16")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon")
    lr_warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 0 to the lr")
    lr_schedule: LrSchedule = Field(LrSchedule.CONSTANT, description="constant|linear|cosine")
    lr_decay_steps: int | None = Field(
        None, ge=1, description="step at which linear/cosine decay ends (default: --max-steps)"
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="lr floor of the decay, x lr")

    @model_validator(mode="after")
    def _norm(self) -> OptimConfig:
        if self.aggregation is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM and self.norm_tokens is None:
            raise ValueError("aggregation seq-mean-token-sum-norm needs norm_tokens (L)")
        return self

    def bf16(self, device_type: str) -> bool:
        """Whether to autocast to bf16 on a device of this type."""
        if self.precision is Precision.AUTO:
            return device_type == "cuda"
        return self.precision is Precision.BF16


@dataclass(frozen=True, config=COMPONENT)
class ScaleConfig:
    """Memory and layout: FSDP options, micro-batch layout, logprob chunks (docs/learner.md)."""

    max_tokens_per_micro_batch: int = Field(
        0, ge=0, description="token budget per micro-batch, sequences bucketed by length (0: none)"
    )
    packing: bool = Field(
        False, description="pack sequences into one row (the model must honour packed position ids)"
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, le=1_000_000, description="tokens per LM-head chunk of the logprob pass"
    )
    activation_checkpointing: bool = Field(False, description="recompute decoder layers")
    cpu_offload: bool = Field(False, description="FSDP: params, grads, AdamW state on the host")


@dataclass(frozen=True, config=COMPONENT)
class TransferConfig:
    """NCCL-route weight transfer (--weight-transfer nccl): the group the servers join."""

    backend: TransferBackend = Field(TransferBackend.NCCL, description="nccl (vLLM) | gloo (CPU)")
    master_address: str = Field(
        "127.0.0.1", min_length=1, description="address at which the servers reach the learner"
    )
    master_port: int = Field(
        29600, ge=1, le=65535, description="port of the group's rendezvous store on the learner"
    )
    timeout_s: float = Field(
        120.0, gt=0, le=3600, description="limit on forming the group and on each broadcast"
    )


@dataclass(frozen=True, config=COMPONENT)
class BatchRules:
    """Advantages and staleness: what a batch trains."""

    algorithm: Algorithm = Field(Algorithm.GRPO, description="advantage estimator")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount gamma for per-turn returns")
    max_staleness: int = Field(1, ge=0, le=1000, description="policy versions a group may lag")
    stale_policy: StalePolicy = Field(StalePolicy.CORRECT, description="stragglers: correct|drop")
    skip_zero_variance: bool = Field(True, description="skip groups whose returns are all equal")
    # --- issue 15: normalisation, overlong shaping, dynamic sampling ---
    grpo_scale_by_std: bool = Field(True, description="divide GRPO advantages by the group std")
    grpo_std: GroupStd = Field(GroupStd.POPULATION, description="population|unbiased")
    overlong: Overlong = Field(Overlong.NONE, description="episodes cut by a length limit")
    overlong_max_tokens: int | None = Field(None, ge=1, description="L_max of the soft penalty")
    overlong_buffer: int = Field(0, ge=0, description="L_cache: the soft penalty's ramp length")
    overlong_penalty: float = Field(1.0, ge=0.0, description="soft penalty at L >= L_max")
    dynamic_sampling: bool = Field(False, description="fill batches with informative groups")
    dynamic_sampling_max_factor: float = Field(
        4.0, ge=1.0, le=100.0, description="at most this x groups_per_batch groups per batch"
    )

    @model_validator(mode="after")
    def _overlong(self) -> BatchRules:
        if self.overlong is Overlong.SOFT and not (
            self.overlong_max_tokens and 0 < self.overlong_buffer <= self.overlong_max_tokens
        ):
            raise ValueError("overlong soft needs 0 < overlong_buffer <= overlong_max_tokens")
        return self

    @property
    def drop_stale(self) -> bool:
        return self.stale_policy is StalePolicy.DROP


@dataclass(frozen=True, config=COMPONENT)
class LossConfig:
    """Loss terms beyond PPO-clip, PPO epochs and the critic (issue 15; docs/learner.md)."""

    ppo_epochs: int = Field(1, ge=1, le=64, description="passes over each batch")
    mini_batches: int = Field(1, ge=1, le=1024, description="optimizer steps per pass")
    dual_clip: float | None = Field(
        None,
        ge=0.0,
        description="dual-clip c > 1: loss <= -c*A for A < 0; 0: off (default: 3 for the "
        "token ratio, off for GSPO's sequence ratio)",
    )
    policy_ratio: PolicyRatio = Field(
        PolicyRatio.TOKEN, description="clipped ratio: token (PPO) | sequence (GSPO)"
    )
    correction: Correction = Field(Correction.TIS, description="behaviour correction: tis|mis")
    correction_level: CorrectionLevel = Field(
        CorrectionLevel.TOKEN, description="behaviour weight per token | sequence | geometric"
    )
    log_ratio_clamp: float = Field(20.0, gt=0.0, le=80.0, description="|log ratio| bound")
    kl_coef: float = Field(0.0, ge=0.0, description="KL to the initial weights (0: no reference)")
    kl_estimator: KLEstimator = Field(KLEstimator.K3, description="k1|k2|k3")
    kl_mode: KLMode = Field(KLMode.LOSS, description="loss term or reward penalty")
    kl_target: float | None = Field(
        None, gt=0.0, description="adaptive KL controller's target KL per token (None: fixed coef)"
    )
    kl_horizon: int = Field(
        10_000, ge=1, description="adaptive KL controller's horizon, in trained sequences"
    )
    reference_offload: bool = Field(False, description="keep the reference model on the CPU")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: loss -= coef*H")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (ppo)")
    value_clip: float = Field(0.2, gt=0.0, description="value-loss clip range (ppo)")
    critic_learning_rate: float = Field(1e-5, gt=0.0, le=1.0, description="critic AdamW (ppo)")

    @field_validator("dual_clip")
    @classmethod
    def _dual(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0: off), got {value}")
        return value

    @property
    def dual_clip_c(self) -> float | None:
        """The dual clip's c, or None when it is off: --dual-clip, else 3 for the token ratio
        and off for GSPO's (verl's GSPO has none: a sequence ratio above c would zero the
        gradient of a whole sequence with A < 0)."""
        if self.dual_clip is None:
            return 3.0 if self.policy_ratio is PolicyRatio.TOKEN else None
        return self.dual_clip or None

    @property
    def needs_proximal(self) -> bool:
        """One optimizer step per batch: pi_prox is pi_theta before its update, no recompute."""
        return self.ppo_epochs * self.mini_batches > 1

    @property
    def kl_loss(self) -> bool:
        return self.kl_coef > 0 and self.kl_mode is KLMode.LOSS


def loss_aggregation(optim: OptimConfig, loss: LossConfig) -> Aggregation:
    """--aggregation, or its default: seq-mean (seq-mean-token-mean) with GSPO's sequence
    ratio, as GSPO's paper and verl's ``gspo`` aggregate; token-mean otherwise."""
    if optim.aggregation is not None:
        return optim.aggregation
    return (
        Aggregation.SEQ_MEAN
        if loss.policy_ratio is PolicyRatio.SEQUENCE
        else Aggregation.TOKEN_MEAN
    )


@dataclass(frozen=True, config=COMPONENT)
class CurriculumRules:
    """Difficulty curriculum: the task sampler's config."""

    curriculum: bool = Field(False, description="move difficulty by recent success rate")
    curriculum_window: int = Field(32, ge=1, description="episodes in the success-rate window")
    promote_above: float = Field(0.8, ge=0.0, le=1.0, description="success rate to go harder")
    demote_below: float = Field(0.2, ge=0.0, le=1.0, description="success rate to go easier")
    success_threshold: float = Field(0.5, description="episode return counted as a success")
    difficulty_filter: int = Field(
        0,
        ge=0,
        le=1000,
        description="defer a task after this many groups in a row all "
        "solved or all failed (0: off; prime-rl's difficulty buffer)",
    )
    difficulty_defer_steps: int = Field(
        20, ge=1, le=1_000_000, description="steps a deferred task is left out of the draws"
    )

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
        """The horizon of tasks issued at learner step `step` (None: schedule off).

        The formula is the wrapper's (`envs.wrappers.HorizonSchedule`, one turn a stage):
        these settings only name it for the learner, which stamps the value on each task.
        """
        if self.horizon_start is None or self.horizon_max is None:
            return None
        rising = TurnSchedule(
            start=self.horizon_start, every=self.horizon_every, maximum=self.horizon_max
        )
        return rising.limit(step)


@dataclass(frozen=True, config=COMPONENT)
class EvalConfig:
    """Evaluation on held-out task sets through the same farm (`learner.evaluation`)."""

    eval_tasks: CommaList = Field(
        default_factory=list,
        description="eval sets NAME=FILE (repeatable; JSONL, Parquet or a datasets directory); "
        "each row is scored, never trained",
    )
    eval_interval: int = Field(0, ge=0, description="evaluate every N steps (0: never)")
    eval_before_train: bool = Field(False, description="evaluate the initial weights first")
    eval_samples: int = Field(1, ge=1, le=4096, description="k: samples per eval task")
    eval_temperature: float = Field(
        0.0, ge=0.0, le=10.0, description="eval temperature (0: greedy)"
    )
    eval_max_tokens: int | None = Field(
        None, ge=1, description="eval completion tokens per turn (None: the workers')"
    )
    eval_success_threshold: float = Field(0.5, description="episode return counted as a pass")
    eval_timeout_s: float = Field(
        600.0, gt=0.0, description="limit on one evaluation, and on waiting for it at the end"
    )
    eval_dir: Path | None = Field(
        None, description="where eval-STEP.json go (default: the checkpoint dir; None: none)"
    )

    @field_validator("eval_tasks")
    @classmethod
    def _named(cls, value: list[str]) -> list[str]:
        names = [spec.partition("=")[0] for spec in value]
        for spec, name in zip(value, names, strict=True):
            if not name or not spec.partition("=")[2] or not name.replace("-", "_").isidentifier():
                raise ValueError(
                    f"eval set {spec!r} must be NAME=FILE (NAME: letters, digits, -, _)"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"eval set names repeat: {names}")
        return value

    @property
    def sets(self) -> dict[str, Path]:
        return {n: Path(f) for n, _, f in (spec.partition("=") for spec in self.eval_tasks)}


class LearnerConfig(RunFields, RoleConfig):
    """Everything `python -m learner` needs; see docs/learner.md for the reference."""

    role: ClassVar[str] = "learner"
    error: ClassVar[type[Exception]] = ConfigError

    # --- model, inference (run, Redis: `RunFields`) -------------------------------------------------------
    model: Path = Field(description="Hugging Face model directory (weights, config, tokenizer)")
    inference_urls: CommaList = Field(
        default_factory=list, description="inference servers to push weights to (comma-separated)"
    )
    inference_api_key: SecretStr | None = Field(None, description="bearer token for the servers")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port (0: none)")
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
    weight_transfer: WeightTransfer = Field(
        WeightTransfer.FILE, description="file (reload from disk) | nccl (vLLM's NCCL routes)"
    )
    transfer: TransferConfig = section(TransferConfig, prefix="weight_transfer_")
    # --- task source and replay ---------------------------------------------------------------
    tasks: Path | None = Field(
        None, description="task dataset: JSONL, Parquet or a datasets directory (None: no feeding)"
    )
    max_failed_batches: int = Field(
        10, ge=0, description="stop after this many batches in a row spoiled by infra/spec errors"
    )
    replay: str | None = Field(None, description="archive path or stream:START..END to train from")
    # --- consumer -----------------------------------------------------------------------------
    consumer: ConsumerSettings = section(
        ConsumerSettings, reclaim_idle_s=3600.0, max_deliveries=10
    )  # a dead learner's groups wait long: its own stay pending until a checkpoint holds them
    streams: StreamBounds = section(StreamBounds, prefix="stream_")  # broker.trim, run by rank 0
    # --- components ---------------------------------------------------------------------------
    optim: OptimConfig = section(OptimConfig)
    scale: ScaleConfig = section(ScaleConfig)
    batch: BatchRules = section(BatchRules)
    curriculum: CurriculumRules = section(CurriculumRules)
    horizon: HorizonSchedule = section(HorizonSchedule)
    loss: LossConfig = section(LossConfig)
    tracking: TrackingConfig = section(TrackingConfig)  # docs/tracking.md
    evaluation: EvalConfig = section(EvalConfig)
    data: DataConfig = section(DataConfig)  # learner.dataspec: datasets of prompts
    lora: LoraSettings = section(LoraSettings, prefix="lora_")  # learner.lora
    collapse: CollapseRules = section(CollapseRules, prefix="collapse_")  # learner.collapse
    progress: ProgressRules = section(ProgressRules)  # learner.progress: idle and solved runs

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs checkpoint_dir")
        optim = self.optim
        if optim.lr_schedule is not LrSchedule.CONSTANT and not (
            optim.lr_decay_steps or self.max_steps
        ):
            raise ValueError(f"lr_schedule {optim.lr_schedule} needs lr_decay_steps or max_steps")
        evaluation = self.evaluation
        if (evaluation.eval_interval or evaluation.eval_before_train) and not evaluation.eval_tasks:
            raise ValueError("eval_interval and eval_before_train need eval_tasks NAME=FILE")
        if self.loss.kl_target is not None and not self.loss.kl_coef:
            raise ValueError("kl_target (the adaptive KL controller) needs kl_coef > 0 to start")
        return self

    @property
    def lr_decay_steps(self) -> int:
        """Where the decay ends: --lr-decay-steps, else --max-steps (0: no decay)."""
        return self.optim.lr_decay_steps or self.max_steps

    @property
    def admission_steps(self) -> int:
        """Steps of groups admission may hold: max_staleness + 1, less the push lag.

        Weights reach the servers every push_interval steps, so a task issued now may
        sample weights push_interval - 1 steps older than the learner's step.
        """
        lag = max(self.push_interval - 1, 0)
        return max(self.batch.max_staleness + 1 - lag, 1)

    @property
    def admission_limit(self) -> int:
        """Tasks (groups) allowed in flight or buffered: admission_steps x groups_per_batch."""
        return self.admission_steps * self.groups_per_batch
