"""The learner's core: model, optimizer and state on every rank, and the collective commands
rank 0 announces (train, save, export, stream, stop) that the other ranks follow.

Rank 0 drives a `Core` from the live loop (`learner.service`) or a replay (`learner.replay`);
every other rank runs `run_follower`, which joins each collective rank 0 announces, so FSDP's
gathers and reductions always have every rank in them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from broker.messages import TrajectoryGroup
from inference.nccl import WeightStream
from learner.batch import PreparedBatch, prepare_batch
from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_state,
    load_training_state,
    save_checkpoint,
)
from learner.collapse import CollapseWatch, batch_shape
from learner.components import critic_for, reference_for
from learner.config import KLMode, LearnerConfig, Overlong
from learner.critic import Critic, restore_critic, save_critic
from learner.distributed import DistContext
from learner.errors import ConfigError
from learner.export import export_hf_dir, full_weights
from learner.lora import LoraExport, apply_lora, merged_weights, save_adapter
from learner.record import SkipRecord, StepRecord
from learner.reference import Reference, kl_token_penalties
from learner.schedule import adaptive_kl, learning_rate
from learner.tracking.base import Tracker
from learner.trainer import StepStats, Trainer
from learner.weights import weight_stream

log = logging.getLogger("learner")


def resolve_device(cfg: LearnerConfig, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(cfg.device)


TRAIN, SAVE, EXPORT, STREAM, STOP = "train", "save", "export", "stream", "stop"  # rank 0's


@dataclass
class Core:
    """Model, optimizer and learner state, identical on every rank."""

    cfg: LearnerConfig
    dist: DistContext
    trainer: Trainer
    state: LearnerState
    checkpoint: Path | None  # the checkpoint resumed from
    reference: Reference | None = None  # KL as a reward penalty (the trainer holds the loss one)
    critic: Critic | None = None  # --algorithm ppo
    stopped: bool = False  # rank 0 has released the other ranks
    tracker: Tracker = dataclasses.field(default_factory=Tracker.off)  # rank 0's (--tracker)
    collapse: CollapseWatch | None = None  # rank 0's: built from cfg.collapse on first use

    def watch_collapse(self, reward_mean: float, rollout_entropy: float | None) -> None:
        """Feed one batch (step or skipped) to the collapse watch (`learner.collapse`)."""
        if self.collapse is None:
            self.collapse = CollapseWatch(self.cfg.collapse)
        self.collapse.observe(reward_mean, rollout_entropy, self.state.step)

    def prepare(self, groups: list[TrajectoryGroup], replay: bool) -> PreparedBatch:
        """The batch's sequences; with a KL reward penalty, rewards shaped by the reference.

        A replay trains what was recorded: its versions are not this run's."""
        rules, version, judge = self.cfg.batch, self.state.step, not replay
        if self.reference is None:
            return prepare_batch(groups, rules, version, judge_staleness=judge)
        # every episode's sequences: the penalty may give a zero-variance group variance, and
        # an overlong-masked episode's return enters its group's baseline penalised like any
        every = prepare_batch(
            groups,
            dataclasses.replace(rules, skip_zero_variance=False, overlong=Overlong.NONE),
            version,
            judge_staleness=judge,
        )
        coef = self.trainer.kl_coef
        penalties = kl_token_penalties(
            self.reference, every.samples, self.trainer.scoring, self.cfg.loss.kl_estimator, coef
        )
        prepared = prepare_batch(groups, rules, version, penalties, judge_staleness=judge)
        tokens = max(every.num_tokens, 1)
        total = sum(float(p.sum()) for turns in penalties.values() for p in turns.values())
        prepared.reward_kl = total / coef / tokens
        return prepared

    def _update(self, prepared: PreparedBatch) -> StepStats:
        """Optimizer steps on the batch (and the critic's, with --algorithm ppo)."""
        samples = prepared.samples
        if self.critic is not None:
            samples = self.critic.annotate(samples)
            prepared.advantages = [float(a) for s in samples for a in s.advantages[s.loss_mask > 0]]
        stats = self.trainer.update(samples)
        if prepared.reward_kl is not None:  # the KL rode on the rewards, not in the loss
            stats = dataclasses.replace(stats, kl=prepared.reward_kl)
        if self.critic is not None:
            loss = self.cfg.loss
            value_loss = self.critic.update(samples, loss.ppo_epochs, loss.mini_batches)
            stats = dataclasses.replace(stats, value_loss=value_loss)
        return stats

    def train(
        self, groups: list[TrajectoryGroup], replay: bool
    ) -> tuple[PreparedBatch, StepStats | None]:
        """Prepare and train one batch (rank 0 announces and broadcasts it; every rank trains
        its share). A batch with no trainable sample, or whose every optimizer step met an
        exactly-zero gradient (`Trainer.step` skips those), is not a step: the step, the
        policy version, the learning-rate schedule and --max-steps stay where they are
        (stats None)."""
        if self.dist.is_main:
            self.dist.broadcast_command(TRAIN)
            self.dist.broadcast_groups(groups)
        self.trainer.set_learning_rate(
            learning_rate(self.cfg.optim, self.state.step, self.cfg.lr_decay_steps)
        )
        prepared = self.prepare(groups, replay)
        stats = self._update(prepared) if prepared.samples else None
        if stats is not None and stats.zero_gradient_steps:
            self.state.count("zero_gradient_steps", stats.zero_gradient_steps)
        if stats is not None and stats.optimizer_steps:
            self._adapt_kl(stats)
            self.state.step += 1
            self.state.record_step([g.group_id for g in groups])
        else:
            stats = None
            self.state.count("skipped_batches", 1)
        self.state.count("groups", len(groups))
        self.state.count("trained_groups", len(prepared.trained_groups))
        self.state.count("infra_failed", len(prepared.infra_failed))
        self.state.count("no_action_timeouts", len(prepared.no_action_timeouts))
        self.state.count("overlong", prepared.overlong)
        self.state.count("zero_variance", len(prepared.zero_variance))
        self.state.count("stale_dropped", len(prepared.dropped_stale))
        self.state.count("stale_corrected", len(prepared.corrected_stale))
        return prepared, stats

    def _adapt_kl(self, stats: StepStats) -> None:
        """The adaptive KL controller: move the coefficient toward --kl-target."""
        loss = self.cfg.loss
        if loss.kl_target is None:
            return
        coef = adaptive_kl(
            self.trainer.kl_coef, stats.kl, loss.kl_target, stats.sequences, loss.kl_horizon
        )
        self.trainer.kl_coef = self.state.kl_coef = coef

    def save(self) -> Path | None:
        """Write a checkpoint (collective: rank 0 announces it to the others)."""
        if self.cfg.checkpoint_dir is None:
            return None
        if self.critic is not None and self.dist.is_main:  # first: no checkpoint without it
            save_critic(
                self.critic, self.cfg.checkpoint_dir, self.state.step, self.cfg.keep_checkpoints
            )
        if self.dist.is_main:
            self.dist.broadcast_command(SAVE)
        return save_checkpoint(
            self.cfg.checkpoint_dir,
            self.trainer.policy,
            self.trainer.optimizer,
            self.state,
            self.dist,
            tokenizer_dir=self.cfg.model,
            keep=self.cfg.keep_checkpoints,
        )

    def export(self, out_dir: Path) -> int:
        """Stream the full weights into a servable directory (collective, as `save`); a
        LoRA run writes its peft adapter directory, or the weights with it merged in."""
        if self.dist.is_main:
            self.dist.broadcast_command(EXPORT, str(out_dir))
        lm, lora, main = self.trainer.model, self.cfg.lora, self.dist.is_main
        if lora.enabled and lora.export is LoraExport.ADAPTER:
            return save_adapter(lm, out_dir, main)
        weights = merged_weights(lm) if lora.enabled else None
        return export_hf_dir(lm, out_dir, main, self.cfg.model, weights)

    def weight_stream(self) -> WeightStream:
        """The full weights for an NCCL-route push, gathered as sent (collective, as `export`)."""
        return weight_stream(self.trainer.model, lambda: self.dist.broadcast_command(STREAM))

    def stop_followers(self) -> None:
        """Release the other ranks (once; rank 0 calls it however its loop ended)."""
        if self.dist.is_main and self.dist.enabled and not self.stopped:
            self.stopped = True
            self.dist.broadcast_command(STOP)


def build_core(cfg: LearnerConfig, dist: DistContext, device: torch.device) -> Core:
    """Load the model (from the latest checkpoint when resuming) and the optimizer."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(cfg.seed)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    checkpoint = None
    if cfg.resume and cfg.checkpoint_dir is not None:
        checkpoint = latest_checkpoint(cfg.checkpoint_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    if cfg.lora.enabled:
        try:
            apply_lora(model, cfg.lora, cfg.model)
        except ValueError as exc:  # peft: no module matches the targets
            raise ConfigError(f"--lora-target-modules: {exc}") from exc
    reference = reference_for(cfg, device, model, dist)
    kl_loss = cfg.loss.kl_mode is KLMode.LOSS
    trainer = Trainer(
        model,
        cfg.optim,
        device,
        dist,
        scale=cfg.scale,
        loss=cfg.loss,
        reference=reference if kl_loss else None,
    )
    log.info(
        "training on %s, world %d (%s)",
        device,
        dist.world,
        "FSDP2" if dist.enabled else "one process",
    )
    critic = critic_for(cfg, device, dist)
    state = LearnerState()
    if checkpoint is not None:
        state = load_state(checkpoint)
        load_training_state(checkpoint, trainer.policy, trainer.optimizer)
        if state.kl_coef is not None:
            trainer.kl_coef = state.kl_coef
        if critic is not None and cfg.checkpoint_dir is not None:
            restore_critic(critic, cfg.checkpoint_dir, state.step)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    return Core(cfg, dist, trainer, state, checkpoint, None if kl_loss else reference, critic)


def step_record(
    core: Core,
    groups: Sequence[TrajectoryGroup],
    prepared: PreparedBatch,
    stats: StepStats | None,
    *,
    wait_s: float,
    push_s: float,
) -> StepRecord:
    """The typed record of the step just trained (and the collapse watch fed with it)."""
    state, shape = core.state, batch_shape(groups)
    record = StepRecord.measure(
        state.step,
        state.version,
        len(groups),
        prepared,
        stats,
        wait_s=wait_s,
        push_s=push_s,
        shape=shape,
    )
    core.watch_collapse(record.reward_mean, shape.rollout_entropy)
    return record


def skip_record(
    core: Core, groups: Sequence[TrajectoryGroup], prepared: PreparedBatch, wait_s: float
) -> SkipRecord:
    """The typed record of a batch that trained nothing (not a step; the collapse watch
    sees it all the same: a collapsed policy's batches are mostly skipped)."""
    state, shape = core.state, batch_shape(groups)
    record = SkipRecord.measure(
        state.step, state.version, len(groups), prepared, wait_s=wait_s, shape=shape
    )
    if prepared.episode_returns:
        core.watch_collapse(record.reward_mean, shape.rollout_entropy)
    return record


def run_follower(core: Core) -> None:
    """Ranks other than 0: join whatever rank 0 announces (train, save, export) until stop."""
    replay = core.cfg.replay is not None
    while True:
        command, arg = core.dist.broadcast_command(None)
        if command == TRAIN:
            core.train(core.dist.broadcast_groups(None), replay=replay)
        elif command == SAVE:
            core.save()
        elif command == EXPORT:
            core.export(Path(arg))
        elif command == STREAM:
            for _ in full_weights(core.trainer.model, main=False):
                pass  # rank 0 sends; this rank takes part in each gather
        else:
            return
