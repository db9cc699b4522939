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
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
import torch

from broker.connection import RedisSettings, connect
from broker.consumer import Delivery
from broker.errors import BrokerError, RedisUnavailable
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion, TrajectoryGroup
from broker.outage import retry_while_unavailable
from broker.policy import current_policy, publish_policy
from broker.producer import Producer
from broker.status import refresh_stream_gauges
from inference.nccl import WeightStream
from learner import metrics as m
from learner.batch import PreparedBatch, prepare_batch
from learner.checkpoint import (
    LearnerState,
    latest_checkpoint,
    load_state,
    load_training_state,
    save_checkpoint,
)
from learner.components import critic_for, dynamic_sampling, reference_for
from learner.config import KLMode, LearnerConfig
from learner.critic import Critic, restore_critic, save_critic
from learner.distributed import DistContext
from learner.errors import RunFailedError
from learner.export import export_hf_dir, full_weights
from learner.health import DeadLetterWatch, FailureWatch
from learner.record import SkipRecord, StepRecord, emit, emit_skip
from learner.reference import Reference, kl_turn_penalties
from learner.source import LiveSource
from learner.tasks import (
    TaskFeeder,
    TaskSampler,
    count_in_flight,
    load_dataset,
)
from learner.tracking.base import Tracker
from learner.trainer import StepStats, Trainer
from learner.weights import WeightPusher, weight_stream

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

    def prepare(self, groups: list[TrajectoryGroup], replay: bool) -> PreparedBatch:
        """The batch's sequences; with a KL reward penalty, rewards shaped by the reference.

        A replay trains what was recorded: its versions are not this run's."""
        rules, version, judge = self.cfg.batch, self.state.step, not replay
        if self.reference is None:
            return prepare_batch(groups, rules, version, judge_staleness=judge)
        # every group's sequences, as the penalty may give a zero-variance group variance
        every = prepare_batch(groups, dataclasses.replace(rules, skip_zero_variance=False),
                              version, judge_staleness=judge)  # fmt: skip
        loss = self.cfg.loss
        penalties = kl_turn_penalties(self.reference, every.samples, self.trainer.scoring,
                                      loss.kl_estimator, loss.kl_coef)  # fmt: skip
        return prepare_batch(groups, rules, version, penalties, judge_staleness=judge)

    def _update(self, prepared: PreparedBatch) -> StepStats:
        """Optimizer steps on the batch (and the critic's, with --algorithm ppo)."""
        samples = prepared.samples
        if self.critic is not None:
            samples = self.critic.annotate(samples)
            prepared.advantages = [float(a) for s in samples for a in s.advantages[s.loss_mask > 0]]
        stats = self.trainer.update(samples)
        if self.critic is not None:
            loss = self.cfg.loss
            value_loss = self.critic.update(samples, loss.ppo_epochs, loss.mini_batches)
            stats = dataclasses.replace(stats, value_loss=value_loss)
        return stats

    def train(
        self, groups: list[TrajectoryGroup], replay: bool
    ) -> tuple[PreparedBatch, StepStats | None]:
        """Prepare and train one batch (rank 0 announces and broadcasts it; every rank trains
        its share). A batch with no trainable sample is not a step: the step, the policy
        version and --max-steps stay where they are (stats None)."""
        if self.dist.is_main:
            self.dist.broadcast_command(TRAIN)
            self.dist.broadcast_groups(groups)
        prepared = self.prepare(groups, replay)
        stats = None
        if prepared.samples:
            stats = self._update(prepared)
            self.state.step += 1
            self.state.record_step([g.group_id for g in groups])
        else:
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

    def save(self) -> Path | None:
        """Write a checkpoint (collective: rank 0 announces it to the others)."""
        if self.cfg.checkpoint_dir is None:
            return None
        if self.critic is not None and self.dist.is_main:  # first: no checkpoint without it
            save_critic(self.critic, self.cfg.checkpoint_dir, self.state.step,
                        self.cfg.keep_checkpoints)  # fmt: skip
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
    reference = reference_for(cfg, device)
    kl_loss = cfg.loss.kl_mode is KLMode.LOSS
    trainer = Trainer(model, cfg.optim, device, dist, cfg.scale, cfg.loss,
                      reference=reference if kl_loss else None)  # fmt: skip
    log.info("training on %s, world %d (%s)", device, dist.world,
             "FSDP2" if dist.enabled else "one process")  # fmt: skip
    critic = critic_for(cfg, device, dist)
    state = LearnerState()
    if checkpoint is not None:
        state = load_state(checkpoint)
        load_training_state(checkpoint, trainer.policy, trainer.optimizer)
        if critic is not None and cfg.checkpoint_dir is not None:
            restore_critic(critic, cfg.checkpoint_dir, state.step)
        log.info("resumed from %s at step %d", checkpoint, state.step)
    return Core(cfg, dist, trainer, state, checkpoint, None if kl_loss else reference, critic)


def step_record(
    core: Core, prepared: PreparedBatch, stats: StepStats | None, wait_s: float, push_s: float
) -> StepRecord:
    """The typed record of the step just trained."""
    state = core.state
    groups = len(state.trained[-1])
    return StepRecord.measure(state.step, state.version, groups, prepared, stats, wait_s, push_s)


def skip_record(core: Core, prepared: PreparedBatch, groups: int, wait_s: float) -> SkipRecord:
    """The typed record of a batch that trained nothing (not a step)."""
    state = core.state
    return SkipRecord.measure(state.step, state.version, groups, prepared, wait_s)


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
        source = await _make_source(core, redis, keys, feeder, stop)
        await retry_while_unavailable(lambda: _publish_initial(redis, keys, state), "policy", stop)
        unacked: list[Delivery] = []
        try:
            await _steps(core, Live(source, feeder, pusher, redis, keys), stop, unacked)
        except RunFailedError:
            await _make_durable(core, source, unacked, stop, final=True)  # trained stays trained
            raise
        await _make_durable(core, source, unacked, stop, final=True)
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
            await live.source.commit_trained(batch.deliveries, stop)
            emit_skip(skip_record(core, prepared, len(batch.groups), batch.wait_s), prepared)
            core.tracker.skip(core.state.step)
            failures.observe(batch.groups, 0)  # RunFailedError past the limit
            continue
        failures.observe(batch.groups, len(prepared.samples))
        unacked += batch.deliveries
        push_s = 0.0
        if live.pusher is not None and state.step % cfg.push_interval == 0:
            push_s = await _push(core, live.pusher, live.redis, live.keys, stop)
        record = step_record(core, prepared, stats, batch.wait_s, push_s)
        if live.source.sampling is not None:
            record = dataclasses.replace(record, filter_rate=round(live.source.sampling.rate, 4))
        emit(record, prepared)
        core.tracker.step(record, batch.groups, prepared)
        last = cfg.max_steps and state.step >= cfg.max_steps
        if cfg.checkpoint_dir is None or state.step % cfg.checkpoint_interval == 0 or last:
            await _make_durable(core, live.source, unacked, stop)


async def _make_durable(
    core: Core,
    source: LiveSource,
    unacked: list[Delivery],
    stop: asyncio.Event,
    final: bool = False,
) -> None:
    """Checkpoint, then ack the entries the checkpoint now holds. At the end (`final`) an
    outage leaves them pending: they are redelivered, and the checkpoint lists them."""
    if not unacked:
        return
    core.save()
    try:
        await source.commit_trained(unacked, stop)
    except RedisUnavailable as exc:
        if not final:
            raise
        log.warning("trained groups left pending at stop: %s", exc)
    unacked.clear()


async def _make_source(
    core: Core,
    redis: aioredis.Redis,
    keys: RunKeys,
    feeder: TaskFeeder | None,
    stop: asyncio.Event,
) -> LiveSource:
    cfg = core.cfg
    vocab = int(core.trainer.model.config.vocab_size)  # type: ignore[union-attr]
    recent = {g for step in core.state.trained[-cfg.checkpoint_interval :] for g in step}
    consumer = LiveSource.consumer_config(cfg.consumer_name, cfg.consumer)
    dead = DeadLetterWatch(redis, keys, cfg.max_failed_batches * cfg.groups_per_batch)
    await retry_while_unavailable(dead.start, "reading the dead letters", stop)
    source = LiveSource(redis, keys, consumer, feeder, vocab, already_trained=recent,
                        sampling=dynamic_sampling(cfg), dead_letters=dead)  # fmt: skip
    await retry_while_unavailable(source.start, "creating the learner group", stop)
    return source


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
    # Tasks are written like commits: on as many replicas before they count as issued.
    producer = Producer(redis, None, cfg.consumer.wait_replicas, cfg.consumer.wait_timeout_ms)
    feeder = TaskFeeder(
        redis, keys, sampler, cfg.horizon, cfg.group_size, cfg.admission_limit, producer
    )
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
    result = await pusher.push(core, version)
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
