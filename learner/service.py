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
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
import torch

from broker.connection import RedisSettings, connect
from broker.errors import BrokerError, RedisUnavailable
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion, TrajectoryGroup
from broker.outage import retry_while_unavailable
from broker.policy import current_policy, publish_policy
from broker.status import refresh_stream_gauges
from learner import metrics as m
from learner.batch import PreparedBatch, prepare_batch
from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_optimizer,
    load_state,
    save_checkpoint,
)
from learner.config import LearnerConfig
from learner.distributed import DistContext
from learner.record import StepRecord, emit
from learner.source import LiveSource
from learner.tasks import (
    TaskFeeder,
    TaskSampler,
    count_in_flight,
    load_dataset,
)
from learner.trainer import StepStats, Trainer
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

    def train(
        self, groups: list[TrajectoryGroup], replay: bool
    ) -> tuple[PreparedBatch, StepStats | None]:
        # a replay trains what was recorded; its versions are not this run's
        prepared = prepare_batch(
            groups, self.cfg.batch, version=self.state.step, judge_staleness=not replay
        )
        stats = None
        if prepared.samples:
            local = self.dist.shard(prepared.samples)
            stats = self.trainer.step(local, prepared.num_tokens, len(prepared.samples))
        self.state.step += 1
        self.state.record_step([g.group_id for g in groups])
        self.state.count("groups", len(groups))
        self.state.count("trained_groups", len(prepared.trained_groups))
        self.state.count("infra_failed", len(prepared.infra_failed))
        self.state.count("zero_variance", len(prepared.zero_variance))
        self.state.count("stale_dropped", len(prepared.dropped_stale))
        self.state.count("stale_corrected", len(prepared.corrected_stale))
        return prepared, stats

    def save(self) -> Path | None:
        if self.cfg.checkpoint_dir is None or not self.dist.is_main:
            return None
        return save_checkpoint(
            self.cfg.checkpoint_dir,
            self.trainer.model,
            self.trainer.optimizer,
            self.state,
            tokenizer_dir=self.cfg.model,
            keep=self.cfg.keep_checkpoints,
        )


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
    trainer = Trainer(model, cfg.optim, device, dist)
    state = LearnerState()
    if checkpoint is not None:
        state = load_state(checkpoint)
        load_optimizer(checkpoint, trainer.optimizer)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    dist.broadcast_model(trainer.model)
    return Core(cfg, dist, trainer, state, checkpoint)


def step_record(
    core: Core, prepared: PreparedBatch, stats: StepStats | None, wait_s: float, push_s: float
) -> StepRecord:
    """The typed record of the step just trained."""
    state = core.state
    groups = len(state.trained[-1])
    return StepRecord.measure(state.step, state.version, groups, prepared, stats, wait_s, push_s)


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
        consumer = LiveSource.consumer_config(
            cfg.consumer_name, cfg.reclaim_idle_s, cfg.max_deliveries
        )
        source = LiveSource(redis, keys, consumer, feeder, vocab, already_trained=recent)
        await retry_while_unavailable(source.start, "creating the learner group", stop)
        await retry_while_unavailable(lambda: _publish_initial(redis, keys, state), "policy", stop)
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
                push_s = await _push(core, pusher, redis, keys, stop)
            emit(step_record(core, prepared, stats, batch.wait_s, push_s), prepared)
            last = cfg.max_steps and state.step >= cfg.max_steps
            if cfg.checkpoint_dir is None or state.step % cfg.checkpoint_interval == 0 or last:
                core.save()
                await source.commit_trained(unacked, stop)
                unacked = []
        if unacked:  # stopped between checkpoints: make the trained groups durable, then ack
            core.save()
            try:
                await source.commit_trained(unacked, stop)
            except RedisUnavailable as exc:  # redelivered later; the checkpoint lists them
                log.warning("trained groups left pending at stop: %s", exc)
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
        except (BrokerError, TimeoutError) as exc:
            log.warning("stream gauges not refreshed: %s", exc)
        await asyncio.sleep(period_s)


async def _make_feeder(core: Core, redis: aioredis.Redis, keys: RunKeys) -> TaskFeeder | None:
    cfg = core.cfg
    if cfg.tasks is None:
        return None
    sampler = TaskSampler(load_dataset(cfg.tasks), cfg.seed, cfg.curriculum)
    sampler.restore(core.state.sampler)
    feeder = TaskFeeder(redis, keys, sampler, cfg.horizon, cfg.group_size, cfg.admission_limit)
    await feeder.start(await count_in_flight(redis, keys, WORKERS_GROUP, LEARNER_GROUP))
    return feeder


async def _publish_initial(redis: aioredis.Redis, keys: RunKeys, state: LearnerState) -> None:
    if await current_policy(redis, keys) is None:
        await publish_policy(redis, keys, PolicyVersion(version=state.version, step=state.step))


async def _push(
    core: Core, pusher: WeightPusher, redis: aioredis.Redis, keys: RunKeys, stop: asyncio.Event
) -> float:
    started = time.perf_counter()
    version = core.state.step
    result = await pusher.push(core.trainer.model, version)
    core.state.version = version
    policy = PolicyVersion(
        version=version,
        step=core.state.step,
        servers=result.servers,
        weights_path=result.weights_path,
    )
    await retry_while_unavailable(
        lambda: publish_policy(redis, keys, policy), "publishing the policy version", stop
    )
    elapsed = time.perf_counter() - started
    m.PUSH_SECONDS.observe(elapsed)
    return elapsed


def run_follower(core: Core) -> None:
    """Ranks other than 0: train whatever rank 0 broadcasts until it sends an empty batch."""
    replay = core.cfg.replay is not None
    while groups := core.dist.broadcast_groups(None):
        core.train(groups, replay=replay)
