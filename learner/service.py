"""The learner loop: batch, train, push, checkpoint, ack; live or from a replay.

One straight line per step on rank 0: take a batch of complete groups from the
source, broadcast it to the other ranks, prepare and train it (every rank its
slice), push the new weights and publish the version every `push_interval`
steps, and every `checkpoint_interval` steps write a checkpoint and only then
ack the entries trained since the previous one. Each step logs one JSON line
(``{"event": "step", ...}``) and updates the Prometheus metrics. SIGTERM stops
after the current step, with a final checkpoint and ack.

A batch with no trainable sample (all zero-variance, infra-failed or dropped) is
not a step: it logs ``{"event": "skipped", ...}``, is counted and acked, and
does not advance the policy version, push weights or count toward max_steps.
`learner.health` stops the run (RunFailedError) when batch after batch is
spoiled by infrastructure errors, or every task comes back dead-lettered.
"""

from __future__ import annotations

import asyncio
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
from broker.consumer import Delivery
from broker.errors import BrokerError
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion, TrajectoryGroup
from broker.policy import current_policy, publish_policy
from broker.status import refresh_stream_gauges
from learner import metrics as m
from learner.batch import BatchRules, PreparedBatch, prepare_batch
from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_state,
    load_training_state,
    save_checkpoint,
)
from learner.config import LearnerConfig, Precision, StalePolicy
from learner.distributed import DistContext
from learner.errors import RunFailedError
from learner.export import export_hf_dir
from learner.health import DeadLetterWatch, FailureWatch
from learner.source import LiveSource
from learner.tasks import (
    CurriculumRules,
    HorizonSchedule,
    TaskFeeder,
    TaskSampler,
    count_in_flight,
    load_dataset,
)
from learner.trainer import OptimConfig, ScaleConfig, StepStats, Trainer
from learner.weights import WeightPusher

log = logging.getLogger("learner")


def resolve_device(cfg: LearnerConfig, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(cfg.device)


TRAIN, SAVE, EXPORT, STOP = "train", "save", "export", "stop"  # rank 0's commands


@dataclass
class Core:
    """Model, optimizer and learner state, identical on every rank."""

    cfg: LearnerConfig
    dist: DistContext
    trainer: Trainer
    state: LearnerState
    checkpoint: Path | None  # the checkpoint resumed from
    stopped: bool = False  # rank 0 has released the other ranks

    def rules(self, replay: bool) -> BatchRules:
        return BatchRules(
            algorithm=self.cfg.algorithm,
            gamma=self.cfg.gamma,
            # a replay trains what was recorded; its versions are not this run's
            max_staleness=10**9 if replay else self.cfg.max_staleness,
            drop_stale=self.cfg.stale_policy is StalePolicy.DROP,
            skip_zero_variance=self.cfg.skip_zero_variance,
        )

    def train(
        self, groups: list[TrajectoryGroup], replay: bool
    ) -> tuple[PreparedBatch, StepStats | None]:
        """Prepare and train one batch (rank 0 announces and broadcasts it; every rank trains
        its share). A batch with no trainable sample is not a step: the step, the policy
        version and --max-steps stay where they are (stats None)."""
        if self.dist.is_main:
            self.dist.broadcast_command(TRAIN)
            self.dist.broadcast_groups(groups)
        prepared = prepare_batch(groups, self.rules(replay), version=self.state.step)
        stats = None
        if prepared.samples:
            stats = self.trainer.step(prepared.samples, prepared.num_tokens, len(prepared.samples))
            self.state.step += 1
            self.state.record_step([g.group_id for g in groups])
        else:
            self.state.count("skipped_batches", 1)
        self.state.count("groups", len(groups))
        self.state.count("trained_groups", len(prepared.trained_groups))
        self.state.count("infra_failed", len(prepared.infra_failed))
        self.state.count("zero_variance", len(prepared.zero_variance))
        self.state.count("stale_dropped", len(prepared.dropped_stale))
        self.state.count("stale_corrected", len(prepared.corrected_stale))
        return prepared, stats

    def save(self) -> Path | None:
        """Write a checkpoint (collective: rank 0 announces it to the others)."""
        if self.cfg.checkpoint_dir is None:
            return None
        if self.dist.is_main:
            self.dist.broadcast_command(SAVE)
        return save_checkpoint(self.cfg.checkpoint_dir, self.trainer.policy,
                               self.trainer.optimizer, self.state, self.dist,
                               tokenizer_dir=self.cfg.model,
                               keep=self.cfg.keep_checkpoints)  # fmt: skip

    def export(self, out_dir: Path) -> int:
        """Stream the full weights into a servable directory (collective, as `save`)."""
        if self.dist.is_main:
            self.dist.broadcast_command(EXPORT, str(out_dir))
        return export_hf_dir(self.trainer.model, out_dir, self.dist.is_main, self.cfg.model)

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
    bf16 = cfg.precision is Precision.BF16 or (
        cfg.precision is Precision.AUTO and device.type == "cuda"
    )
    optim = OptimConfig(
        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, clip_low=cfg.clip_low,
        clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, max_grad_norm=cfg.max_grad_norm,
        micro_batch_size=cfg.micro_batch_size, aggregation=cfg.aggregation, bf16=bf16,
    )  # fmt: skip
    scale = ScaleConfig(
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch, packing=cfg.packing,
        logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        activation_checkpointing=cfg.activation_checkpointing, cpu_offload=cfg.cpu_offload,
    )  # fmt: skip
    trainer = Trainer(model, optim, device, dist, scale)
    log.info("training on %s, world %d (%s)", device, dist.world,
             "FSDP2" if dist.enabled else "one process")  # fmt: skip
    state = LearnerState()
    if checkpoint is not None:
        state = load_state(checkpoint)
        load_training_state(checkpoint, trainer.policy, trainer.optimizer)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    return Core(cfg, dist, trainer, state, checkpoint)


def skip_record(
    core: Core, prepared: PreparedBatch, groups: int, wait_s: float
) -> dict[str, object]:
    """The log line and metrics of a batch that trained nothing (not a step)."""
    returns = np.asarray(prepared.episode_returns or [0.0])
    record: dict[str, object] = {
        "event": "skipped", "step": core.state.step, "version": core.state.version,
        "groups": groups, "reward_mean": float(returns.mean()),
        "zero_variance": len(prepared.zero_variance), "infra_failed": len(prepared.infra_failed),
        "stale_dropped": len(prepared.dropped_stale), "wait_s": round(wait_s, 4),
    }  # fmt: skip
    m.SKIPPED_BATCHES.inc()
    if prepared.episode_returns:
        m.REWARD_MEAN.set(float(returns.mean()))
    m.STALE_GROUPS.labels(action="dropped").inc(len(prepared.dropped_stale))
    m.ZERO_VARIANCE.inc(len(prepared.zero_variance))
    m.INFRA_FAILED.inc(len(prepared.infra_failed))
    return record


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
        "stale_dropped": len(prepared.dropped_stale),
        "stale_corrected": len(prepared.corrected_stale),
        "wait_s": round(wait_s, 4), "compute_s": round(compute_s, 4), "push_s": round(push_s, 4),
        "samples_per_s": round(len(prepared.samples) / max(wait_s + compute_s, 1e-9), 2),
    }  # fmt: skip
    if stats is not None:
        record.update(loss=stats.loss, clip_fraction=stats.clip_fraction, entropy=stats.entropy,
                      ratio_mean=stats.ratio_mean, ratio_max=stats.ratio_max,
                      grad_norm=stats.grad_norm)  # fmt: skip
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
    if "loss" in record:
        m.LOSS.set(float(record["loss"]))  # type: ignore[arg-type]
        m.CLIP_FRACTION.set(float(record["clip_fraction"]))  # type: ignore[arg-type]
        m.ENTROPY.set(float(record["entropy"]))  # type: ignore[arg-type]
        m.RATIO_MEAN.set(float(record["ratio_mean"]))  # type: ignore[arg-type]
        m.RATIO_MAX.set(float(record["ratio_max"]))  # type: ignore[arg-type]
        m.GRAD_NORM.set(float(record["grad_norm"]))  # type: ignore[arg-type]


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
        source = await _make_source(core, redis, keys, feeder)
        if await current_policy(redis, keys) is None:
            await publish_policy(redis, keys, PolicyVersion(version=state.version, step=state.step))
        unacked: list[Delivery] = []
        try:
            await _steps(core, Live(source, feeder, pusher, redis, keys), stop, unacked)
        except RunFailedError:
            await _make_durable(core, source, unacked)  # what was trained stays trained
            raise
        await _make_durable(core, source, unacked)
        return state
    finally:
        if gauges is not None:
            gauges.cancel()
            await asyncio.gather(gauges, return_exceptions=True)
        if pusher is not None:
            await pusher.close()
        await redis.aclose()


@dataclass(frozen=True)
class Live:
    """What the live loop talks to."""

    source: LiveSource
    feeder: TaskFeeder | None
    pusher: WeightPusher | None
    redis: aioredis.Redis
    keys: RunKeys


async def _steps(core: Core, live: Live, stop: asyncio.Event, unacked: list[Delivery]) -> None:
    """Batch, train, push, checkpoint and ack until stop or max_steps; `unacked` is left
    holding the trained entries no checkpoint holds yet."""
    cfg, state = core.cfg, core.state
    failures = FailureWatch(cfg.max_failed_batches)
    while not (cfg.max_steps and state.step >= cfg.max_steps):
        batch = await live.source.next_batch(cfg.groups_per_batch, state.version, state.step, stop)
        if batch is None:
            return
        prepared, stats = core.train(batch.groups, replay=False)
        if live.feeder is not None:
            live.feeder.sampler.observe(prepared.episode_returns)
            state.sampler = live.feeder.sampler.state()
        if stats is None:
            # Not a step: nothing for a checkpoint to hold, so ack now (waiting for the next
            # checkpoint would let a run that trains nothing pile up pending entries).
            await live.source.commit_trained(batch.deliveries)
            emit(skip_record(core, prepared, len(batch.groups), batch.wait_s))
            failures.observe(batch.groups, 0)  # RunFailedError past the limit
            continue
        failures.observe(batch.groups, len(prepared.samples))
        unacked += batch.deliveries
        push_s = 0.0
        if live.pusher is not None and state.step % cfg.push_interval == 0:
            push_s = await _push(core, live.pusher, live.redis, live.keys)
        emit(step_record(core, prepared, stats, batch.wait_s, push_s))
        last = cfg.max_steps and state.step >= cfg.max_steps
        if cfg.checkpoint_dir is None or state.step % cfg.checkpoint_interval == 0 or last:
            await _make_durable(core, live.source, unacked)


async def _make_durable(core: Core, source: LiveSource, unacked: list[Delivery]) -> None:
    """Checkpoint, then ack the entries the checkpoint now holds."""
    if unacked:
        core.save()
        await source.commit_trained(unacked)
        unacked.clear()


async def _make_source(
    core: Core, redis: aioredis.Redis, keys: RunKeys, feeder: TaskFeeder | None
) -> LiveSource:
    cfg = core.cfg
    vocab = int(core.trainer.model.config.vocab_size)  # type: ignore[union-attr]
    recent = {g for step in core.state.trained[-cfg.checkpoint_interval :] for g in step}
    consumer = LiveSource.consumer_config(cfg.consumer_name, cfg.reclaim_idle_s,
                                          cfg.max_deliveries)  # fmt: skip
    dead = DeadLetterWatch(redis, keys, cfg.max_failed_batches * cfg.groups_per_batch)
    await dead.start()
    source = LiveSource(redis, keys, consumer, feeder, vocab, already_trained=recent,
                        dead_letters=dead)  # fmt: skip
    await source.start()
    return source


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
    result = await pusher.push(core.export, version)
    core.state.version = version
    await publish_policy(redis, keys, PolicyVersion(version=version, step=core.state.step,
                                                    servers=result.servers,
                                                    weights_path=result.weights_path))  # fmt: skip
    elapsed = time.perf_counter() - started
    m.PUSH_SECONDS.observe(elapsed)
    return elapsed


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
        else:
            return
