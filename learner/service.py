"""The learner loop: batch, train, push, checkpoint, ack; live or from a replay.

One straight line per step on rank 0: take a batch of complete groups from the
source, broadcast it to the other ranks, prepare and train it (every rank its
slice), push the new weights and publish the version every `push_interval`
steps, and every `checkpoint_interval` steps write a checkpoint and only then
ack the entries trained since the previous one. Each step logs one JSON line
(``{"event": "step", ...}``) and updates the Prometheus metrics. SIGTERM stops
after the current step, with a final checkpoint and ack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from broker.connection import RedisSettings, connect
from broker.errors import BrokerError
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion, TrajectoryGroup
from broker.policy import current_policy, publish_policy
from broker.status import refresh_stream_gauges
from learner import metrics as m
from learner.batch import BatchRules, PreparedBatch, filter_reason, prepare_batch
from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_optimizer,
    load_state,
    save_checkpoint,
)
from learner.config import Algorithm, KLMode, LearnerConfig, Precision, StalePolicy
from learner.critic import Critic, CriticConfig, load_critic, restore_critic, save_critic
from learner.distributed import DistContext
from learner.losses import PolicyLossConfig
from learner.reference import Reference, kl_turn_penalties, load_reference
from learner.sampling import DynamicSampling
from learner.source import LiveSource
from learner.tasks import (
    CurriculumRules,
    HorizonSchedule,
    TaskFeeder,
    TaskSampler,
    count_in_flight,
    load_dataset,
)
from learner.trainer import LossTerms, OptimConfig, StepStats, Trainer
from learner.weights import WeightPusher

log = logging.getLogger("learner")


def resolve_device(cfg: LearnerConfig, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(cfg.device)


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

    def rules(self, replay: bool) -> BatchRules:
        return batch_rules(self.cfg, replay)

    def prepare(self, groups: list[TrajectoryGroup], replay: bool) -> PreparedBatch:
        """The batch's sequences; with a KL reward penalty, rewards shaped by the reference."""
        rules, version = self.rules(replay), self.state.step
        if self.reference is None:
            return prepare_batch(groups, rules, version=version)
        # every group's sequences, as the penalty may give a zero-variance group variance
        every = prepare_batch(groups, dataclasses.replace(rules, skip_zero_variance=False), version)
        t = self.trainer
        penalties = kl_turn_penalties(self.reference, every.samples, t.cfg, t.pad_id, t.device,
                                      self.cfg.kl_estimator, self.cfg.kl_coef)  # fmt: skip
        return prepare_batch(groups, rules, version=version, penalties=penalties)

    def train(
        self, groups: list[TrajectoryGroup], replay: bool
    ) -> tuple[PreparedBatch, StepStats | None]:
        prepared = self.prepare(groups, replay)
        stats = None
        if prepared.samples:
            samples = prepared.samples
            if self.critic is not None:
                samples = self.critic.annotate(samples)
                prepared.advantages = [
                    float(a) for s in samples for a in s.advantages[s.loss_mask > 0]
                ]
            stats = self.trainer.update(samples)
            if self.critic is not None:
                value_loss = self.critic.update(samples, self.cfg.ppo_epochs, self.cfg.mini_batches)
                stats = dataclasses.replace(stats, value_loss=value_loss)
        self.state.step += 1
        self.state.record_step([g.group_id for g in groups])
        self.state.count("groups", len(groups))
        self.state.count("trained_groups", len(prepared.trained_groups))
        self.state.count("infra_failed", len(prepared.infra_failed))
        self.state.count("no_action_timeouts", len(prepared.no_action_timeouts))
        self.state.count("overlong", prepared.overlong)
        self.state.count("zero_variance", len(prepared.zero_variance))
        self.state.count("stale_dropped", len(prepared.dropped_stale))
        self.state.count("stale_corrected", len(prepared.corrected_stale))
        return prepared, stats

    def save(self) -> Path | None:
        if self.cfg.checkpoint_dir is None or not self.dist.is_main:
            return None
        if self.critic is not None:  # first, so that no checkpoint exists without its critic
            save_critic(self.critic, self.cfg.checkpoint_dir, self.state.step,
                        self.cfg.keep_checkpoints)  # fmt: skip
        return save_checkpoint(self.cfg.checkpoint_dir, self.trainer.model, self.trainer.optimizer,
                               self.state, tokenizer_dir=self.cfg.model,
                               keep=self.cfg.keep_checkpoints)  # fmt: skip


def batch_rules(cfg: LearnerConfig, replay: bool) -> BatchRules:
    """What a batch trains; a replay's versions are not this run's, so nothing is stale."""
    return BatchRules(
        algorithm=cfg.algorithm,
        gamma=cfg.gamma,
        max_staleness=None if replay else cfg.max_staleness,
        drop_stale=cfg.stale_policy is StalePolicy.DROP,
        skip_zero_variance=cfg.skip_zero_variance,
        scale_by_std=cfg.grpo_scale_by_std,
        group_std=cfg.grpo_std,
        overlong=cfg.overlong,
        overlong_max_tokens=cfg.overlong_max_tokens or 0,
        overlong_buffer=cfg.overlong_buffer,
        overlong_penalty=cfg.overlong_penalty,
    )


def optim_config(cfg: LearnerConfig, device: torch.device) -> OptimConfig:
    """The trainer's share of the config."""
    bf16 = cfg.precision is Precision.BF16 or (
        cfg.precision is Precision.AUTO and device.type == "cuda"
    )
    policy = PolicyLossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              dual_clip=cfg.dual_clip, correction=cfg.correction, cap=cfg.tis_cap,
                              log_ratio_clamp=cfg.log_ratio_clamp)  # fmt: skip
    kl_loss = cfg.kl_coef if cfg.kl_mode is KLMode.LOSS else 0.0
    terms = LossTerms(ppo_epochs=cfg.ppo_epochs, mini_batches=cfg.mini_batches, kl_coef=kl_loss,
                      kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef)  # fmt: skip
    return OptimConfig(
        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, micro_batch_size=cfg.micro_batch_size,
        aggregation=cfg.aggregation, bf16=bf16, policy=policy, terms=terms,
    )  # fmt: skip


def dynamic_sampling(cfg: LearnerConfig) -> DynamicSampling | None:
    """Fill each batch with groups that train (DAPO), unless switched off."""
    if not cfg.dynamic_sampling:
        return None
    rules = batch_rules(cfg, replay=False)
    return DynamicSampling(lambda g: filter_reason(g, rules), cfg.groups_per_batch,
                           cfg.dynamic_sampling_max_factor, cfg.admission_steps)  # fmt: skip


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
    source = checkpoint or cfg.model
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    optim = optim_config(cfg, device)
    # The reference is the initial weights (cfg.model, even on resume), loaded only for a KL.
    reference = load_reference(cfg.model, device, cfg.reference_offload) if cfg.kl_coef else None
    loss_reference = reference if cfg.kl_mode is KLMode.LOSS else None
    trainer = Trainer(model, optim, device, dist, reference=loss_reference)
    critic = None
    if cfg.algorithm is Algorithm.PPO:
        critic_cfg = CriticConfig(learning_rate=cfg.critic_learning_rate,
                                  value_clip=cfg.value_clip, gamma=cfg.gamma, lam=cfg.gae_lambda)  # fmt: skip
        critic = load_critic(cfg.model, critic_cfg, optim, device, dist)
    state = LearnerState()
    if checkpoint is not None:
        state = load_state(checkpoint)
        load_optimizer(checkpoint, trainer.optimizer)
        if critic is not None and cfg.checkpoint_dir is not None:
            restore_critic(critic, cfg.checkpoint_dir, state.step)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    dist.broadcast_model(trainer.model)
    reward_reference = reference if cfg.kl_mode is KLMode.REWARD else None
    return Core(cfg, dist, trainer, state, checkpoint, reward_reference, critic)


def step_record(core: Core, prepared: PreparedBatch, stats: StepStats | None, wait_s: float,
                push_s: float) -> dict[str, object]:  # fmt: skip
    """The step's log line and metrics."""
    returns = np.asarray(prepared.episode_returns or [0.0])
    adv = np.asarray(prepared.advantages or [0.0])
    compute_s = stats.compute_s if stats else 0.0
    record: dict[str, object] = {
        "event": "step", "step": core.state.step, "version": core.state.version,
        "groups": len(core.state.trained[-1]), "trained_groups": len(prepared.trained_groups),
        "samples": len(prepared.samples), "tokens": prepared.num_tokens,
        "reward_mean": float(returns.mean()), "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()), "staleness_max": max(prepared.staleness, default=0),
        "zero_variance": len(prepared.zero_variance), "infra_failed": len(prepared.infra_failed),
        "no_action_timeouts": len(prepared.no_action_timeouts), "overlong": prepared.overlong,
        "stale_dropped": len(prepared.dropped_stale),
        "stale_corrected": len(prepared.corrected_stale),
        "wait_s": round(wait_s, 4), "compute_s": round(compute_s, 4), "push_s": round(push_s, 4),
        "samples_per_s": round(len(prepared.samples) / max(wait_s + compute_s, 1e-9), 2),
    }  # fmt: skip
    if stats is not None:
        record.update(loss=stats.loss, clip_fraction=stats.clip_fraction, entropy=stats.entropy,
                      ratio_mean=stats.ratio_mean, ratio_max=stats.ratio_max,
                      grad_norm=stats.grad_norm, dual_clip_fraction=stats.dual_clip_fraction,
                      correction_fraction=stats.correction_fraction, kl=stats.kl,
                      behaviour_ratio_mean=stats.behaviour_ratio_mean,
                      behaviour_ratio_max=stats.behaviour_ratio_max,
                      optimizer_steps=stats.optimizer_steps)  # fmt: skip
        if stats.value_loss is not None:
            record["value_loss"] = stats.value_loss
    _export(record, prepared)
    return record


def _export(record: dict[str, object], prepared: PreparedBatch) -> None:
    m.STEPS.inc()
    m.STEP_SECONDS.observe(float(record["wait_s"]) + float(record["compute_s"]))  # type: ignore[arg-type]
    m.WAIT_SECONDS.observe(float(record["wait_s"]))  # type: ignore[arg-type]
    m.SAMPLES.inc(len(prepared.samples))
    m.REWARD_MEAN.set(float(record["reward_mean"]))  # type: ignore[arg-type]
    m.ADVANTAGE_MEAN.set(float(record["adv_mean"]))  # type: ignore[arg-type]
    m.ADVANTAGE_STD.set(float(record["adv_std"]))  # type: ignore[arg-type]
    m.POLICY_VERSION.set(float(record["version"]))  # type: ignore[arg-type]
    m.LAST_STEP.set(time.time())
    for s in prepared.staleness:
        m.STALENESS.observe(s)
    m.STALE_GROUPS.labels(action="dropped").inc(len(prepared.dropped_stale))
    m.STALE_GROUPS.labels(action="corrected").inc(len(prepared.corrected_stale))
    m.ZERO_VARIANCE.inc(len(prepared.zero_variance))
    m.INFRA_FAILED.inc(len(prepared.infra_failed))
    m.NO_ACTION_TIMEOUTS.inc(len(prepared.no_action_timeouts))
    m.OVERLONG.inc(prepared.overlong)
    if "loss" in record:
        m.LOSS.set(float(record["loss"]))  # type: ignore[arg-type]
        m.CLIP_FRACTION.set(float(record["clip_fraction"]))  # type: ignore[arg-type]
        m.ENTROPY.set(float(record["entropy"]))  # type: ignore[arg-type]
        m.RATIO_MEAN.set(float(record["ratio_mean"]))  # type: ignore[arg-type]
        m.RATIO_MAX.set(float(record["ratio_max"]))  # type: ignore[arg-type]
        m.GRAD_NORM.set(float(record["grad_norm"]))  # type: ignore[arg-type]
        m.DUAL_CLIP_FRACTION.set(float(record["dual_clip_fraction"]))  # type: ignore[arg-type]
        m.CORRECTION_FRACTION.set(float(record["correction_fraction"]))  # type: ignore[arg-type]
        m.KL.set(float(record["kl"]))  # type: ignore[arg-type]
        m.BEHAVIOUR_RATIO_MAX.set(float(record["behaviour_ratio_max"]))  # type: ignore[arg-type]
    if "value_loss" in record:
        m.VALUE_LOSS.set(float(record["value_loss"]))  # type: ignore[arg-type]


def emit(record: dict[str, object]) -> None:
    log.info("%s", json.dumps(record, sort_keys=False))


def install_stop(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def run_live(core: Core, stop: asyncio.Event) -> LearnerState:
    """Rank 0's live loop; returns the final state."""
    cfg, state = core.cfg, core.state
    redis = await connect(RedisSettings.from_url(cfg.redis_url))
    keys = RunKeys(cfg.run, cfg.partitions)
    pusher = WeightPusher(cfg) if cfg.inference_urls and cfg.push_interval else None
    # The learner is the one long-lived process per run: it exports the run's stream gauges.
    gauges = (
        asyncio.create_task(export_stream_gauges(redis, keys), name="stream-gauges")
        if cfg.metrics_port
        else None
    )
    try:
        feeder = await _make_feeder(core, redis, keys)
        vocab = int(core.trainer.model.config.vocab_size)  # type: ignore[union-attr]
        recent = {g for step in state.trained[-cfg.checkpoint_interval :] for g in step}
        consumer = LiveSource.consumer_config(cfg.consumer_name, cfg.reclaim_idle_s,
                                              cfg.max_deliveries)  # fmt: skip
        sampling = dynamic_sampling(cfg)
        source = LiveSource(redis, keys, consumer, feeder, vocab, already_trained=recent,
                            sampling=sampling)  # fmt: skip
        await source.start()
        if await current_policy(redis, keys) is None:
            await publish_policy(redis, keys, PolicyVersion(version=state.version, step=state.step))
        unacked = []
        while not (cfg.max_steps and state.step >= cfg.max_steps):
            batch = await source.next_batch(cfg.groups_per_batch, state.version, state.step, stop)
            if batch is None:
                break
            core.dist.broadcast_groups(batch.groups)
            prepared, stats = core.train(batch.groups, replay=False)
            unacked += batch.deliveries
            if feeder is not None:
                feeder.sampler.observe(prepared.episode_returns)
                state.sampler = feeder.sampler.state()
            push_s = 0.0
            if pusher is not None and state.step % cfg.push_interval == 0:
                push_s = await _push(core, pusher, redis, keys)
            record = step_record(core, prepared, stats, batch.wait_s, push_s)
            if sampling is not None:
                record["filter_rate"] = round(sampling.rate, 4)
            emit(record)
            last = cfg.max_steps and state.step >= cfg.max_steps
            if cfg.checkpoint_dir is None or state.step % cfg.checkpoint_interval == 0 or last:
                core.save()
                await source.commit_trained(unacked)
                unacked = []
        if unacked:  # stopped between checkpoints: make the trained groups durable, then ack
            core.save()
            await source.commit_trained(unacked)
        return state
    finally:
        core.dist.broadcast_groups([])
        if gauges is not None:
            gauges.cancel()
            await asyncio.gather(gauges, return_exceptions=True)
        if pusher is not None:
            await pusher.close()
        await redis.aclose()


async def export_stream_gauges(redis: aioredis.Redis, keys: RunKeys, period_s: float = 5.0) -> None:
    """Refresh stream length, lag, pending and admission gauges until cancelled."""
    while True:
        try:
            async with asyncio.timeout(period_s):
                await refresh_stream_gauges(redis, keys)
        except (BrokerError, RedisError, TimeoutError) as exc:
            log.warning("stream gauges not refreshed: %s", exc)
        await asyncio.sleep(period_s)


async def _make_feeder(core: Core, redis: aioredis.Redis, keys: RunKeys) -> TaskFeeder | None:
    cfg = core.cfg
    if cfg.tasks is None:
        return None
    rules = CurriculumRules(enabled=cfg.curriculum, window=cfg.curriculum_window,
                            promote_above=cfg.promote_above, demote_below=cfg.demote_below,
                            success_threshold=cfg.success_threshold)  # fmt: skip
    sampler = TaskSampler(load_dataset(cfg.tasks), cfg.seed, rules)
    sampler.restore(core.state.sampler)
    horizon = HorizonSchedule(cfg.horizon_start, cfg.horizon_max, cfg.horizon_every)
    feeder = TaskFeeder(redis, keys, sampler, horizon, cfg.group_size, cfg.admission_limit)
    await feeder.start(await count_in_flight(redis, keys, WORKERS_GROUP, LEARNER_GROUP))
    return feeder


async def _push(core: Core, pusher: WeightPusher, redis: aioredis.Redis, keys: RunKeys) -> float:
    started = time.perf_counter()
    version = core.state.step
    result = await pusher.push(core.trainer.model, version)
    core.state.version = version
    await publish_policy(redis, keys, PolicyVersion(version=version, step=core.state.step,
                                                    servers=result.servers,
                                                    weights_path=result.weights_path))  # fmt: skip
    elapsed = time.perf_counter() - started
    m.PUSH_SECONDS.observe(elapsed)
    return elapsed


def run_follower(core: Core) -> None:
    """Ranks other than 0: train whatever rank 0 broadcasts until it sends an empty batch."""
    replay = core.cfg.replay is not None
    while groups := core.dist.broadcast_groups(None):
        core.train(groups, replay=replay)
