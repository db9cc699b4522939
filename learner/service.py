"""The learner loop: batch, train, push, checkpoint, ack; live or from a replay.

One straight line per step on rank 0: take a batch of complete groups from the
source, broadcast it to the other ranks, prepare and train it (every rank its
slice), push the new weights and publish the version every `push_interval`
steps, and every `checkpoint_interval` steps write a checkpoint and only then
ack the entries trained since the previous one. Alongside, it keeps the run's streams
trimmed to what is unacknowledged and holds admission at one batch while a stream is
over its bounds (`broker.trim`). Each step logs one JSON line
(``{"event": "step", ...}``) and updates the Prometheus metrics. SIGTERM stops
after the current step, with a final checkpoint and ack.

A batch with no trainable sample (all zero-variance, infra-failed or dropped) is
not a step: it logs ``{"event": "skipped", ...}``, is counted and acked, and
does not advance the policy version, push weights or count toward max_steps.
`learner.progress` warns when batch after batch trains nothing, and with
``--stop-when-solved`` ends the run once the reward has stayed at its target.
`learner.health` stops the run (RunFailedError) when batch after batch is
spoiled by infrastructure errors, or every task comes back dead-lettered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from broker.admission import AdmissionBudget
from broker.connection import RedisSettings, connect
from broker.consumer import Delivery
from broker.errors import RedisUnavailable
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion
from broker.outage import retry_while_unavailable
from broker.policy import current_policy, publish_policy
from broker.producer import Producer
from broker.status import export_stream_gauges
from broker.trim import StreamKeeper, StreamTrimmer
from learner import metrics as m
from learner.checkpoint import LearnerState
from learner.components import dynamic_sampling
from learner.core import Core, skip_record, step_record
from learner.errors import RunFailedError
from learner.evaluation import EvalSchedule, Evaluator, load_sets
from learner.health import DeadLetterWatch, FailureWatch
from learner.progress import Progress
from learner.record import emit, emit_skip
from learner.source import LiveSource
from learner.tasks import TaskFeeder, TaskSampler, count_in_flight, load_dataset, row_returns
from learner.weights import WeightPusher

log = logging.getLogger("learner")


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
    keeping: asyncio.Task | None = None
    done = asyncio.Event()  # ends the stream keeper however the loop ends
    try:
        feeder = await _make_feeder(core, redis, keys)
        keeper = _make_keeper(core, redis, keys, feeder)
        keeping = asyncio.create_task(keeper.run(done), name="stream-keeper")
        source = await _make_source(core, redis, keys, feeder, stop)
        await retry_while_unavailable(lambda: _publish_initial(redis, keys, state), "policy", stop)
        evals = await _make_evals(core, redis, keys)
        unacked: list[Delivery] = []
        try:
            if evals is not None and cfg.evaluation.eval_before_train and not state.step:
                await evals.before_train(state.step, state.version)
            await _steps(core, Live(source, feeder, pusher, redis, keys, evals), stop, unacked)
        except RunFailedError:
            await _make_durable(core, source, unacked, stop, final=True)  # trained stays trained
            raise
        finally:
            if evals is not None:
                await evals.close()
        await _make_durable(core, source, unacked, stop, final=True)
        return state
    finally:
        done.set()
        await _shut_down(keeping, gauges, pusher, redis)


# How long each part of the shutdown may take once the run is over. The learner twice sat
# for minutes after its last step in the compose tests, under load, never logging `done`:
# each part now has a deadline, and the one that misses it is named (SIGUSR1 shows where).
SHUTDOWN_PART_S = 15.0


async def _shut_down(
    keeping: asyncio.Task | None,
    gauges: asyncio.Task | None,
    pusher: WeightPusher | None,
    redis: aioredis.Redis,
) -> None:
    """Stop the background tasks and close the clients, each within `SHUTDOWN_PART_S`."""
    if gauges is not None:
        gauges.cancel()
    parts = [
        ("the stream keeper", keeping),
        ("the stream gauges", gauges),
        ("the weight pusher", pusher.close() if pusher is not None else None),
        ("the Redis client", redis.aclose()),
    ]
    for what, part in parts:
        if part is None:
            continue
        task = asyncio.ensure_future(part)
        finished, _ = await asyncio.wait([task], timeout=SHUTDOWN_PART_S)
        if not finished:
            task.cancel()
            log.warning(
                "%s did not stop within %g s after the run; left behind", what, SHUTDOWN_PART_S
            )
        elif not task.cancelled() and task.exception() is not None:
            log.warning("%s failed while stopping: %s", what, task.exception())


@dataclass(frozen=True)
class Live:
    """What the live loop talks to."""

    source: LiveSource
    feeder: TaskFeeder | None
    pusher: WeightPusher | None
    redis: aioredis.Redis
    keys: RunKeys
    evals: EvalSchedule | None = None


async def _steps(core: Core, live: Live, stop: asyncio.Event, unacked: list[Delivery]) -> None:
    """Batch, train, push, checkpoint and ack until stop or max_steps; `unacked` is left
    holding the trained entries no checkpoint holds yet."""
    cfg, state = core.cfg, core.state
    failures = FailureWatch(cfg.max_failed_batches)
    progress = Progress.of(cfg.progress)
    while not (cfg.max_steps and state.step >= cfg.max_steps):
        batch = await live.source.next_batch(cfg.groups_per_batch, state.version, state.step, stop)
        if batch is None:
            break
        prepared, stats = core.train(batch.groups, replay=False)
        if live.feeder is not None:
            live.feeder.sampler.observe(prepared.episode_returns)
            live.feeder.sampler.observe_groups(row_returns(batch.groups), state.step)
            state.sampler = live.feeder.sampler.state()
        if stats is None:
            # Not a step: nothing for a checkpoint to hold, so ack now (waiting for the next
            # checkpoint would let a run that trains nothing pile up pending entries).
            await live.source.commit_trained(batch.deliveries, stop)
            skipped = skip_record(core, batch.groups, prepared, batch.wait_s)
            emit_skip(skipped, prepared)
            core.tracker.skip(skipped)
            failures.observe(batch.groups, 0)  # RunFailedError past the limit
            if progress.observe(skipped, trained=False):
                break
            continue
        failures.observe(batch.groups, len(prepared.samples))
        unacked += batch.deliveries
        push_s = 0.0
        if live.pusher is not None and state.step % cfg.push_interval == 0:
            push_s = await _push(core, live.pusher, live.redis, live.keys, stop)
        record = step_record(
            core, batch.groups, prepared, stats, wait_s=batch.wait_s, push_s=push_s
        )
        if live.source.sampling is not None:
            record = dataclasses.replace(record, filter_rate=round(live.source.sampling.rate, 4))
        emit(record, prepared)
        core.tracker.step(record, batch.groups, prepared)
        last = cfg.max_steps and state.step >= cfg.max_steps
        if cfg.checkpoint_dir is None or state.step % cfg.checkpoint_interval == 0 or last:
            await _make_durable(core, live.source, unacked, stop)
        if live.evals is not None:
            await live.evals.after_step(state.step, state.version)
        if progress.observe(
            record, trained=True
        ):  # solved: run_live checkpoints and acks what is left
            break
    if live.evals is not None:  # the round in flight, within its deadline
        await live.evals.drain()


async def _make_evals(core: Core, redis: aioredis.Redis, keys: RunKeys) -> EvalSchedule | None:
    cfg = core.cfg
    if not cfg.evaluation.eval_tasks:
        return None
    evaluator = Evaluator(
        redis,
        keys,
        load_sets(cfg.evaluation, cfg.data),
        cfg.evaluation,
        cfg.consumer_name,
        settings=cfg.consumer,
    )
    await evaluator.start()
    out_dir = cfg.evaluation.eval_dir or cfg.checkpoint_dir
    return EvalSchedule(evaluator, out_dir, core.tracker.evaluation)


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
    source = LiveSource(
        redis,
        keys,
        consumer,
        feeder,
        vocab,
        already_trained=recent,
        sampling=dynamic_sampling(cfg),
        dead_letters=dead,
    )
    await retry_while_unavailable(source.start, "creating the learner group", stop)
    return source


def _make_keeper(
    core: Core, redis: aioredis.Redis, keys: RunKeys, feeder: TaskFeeder | None
) -> StreamKeeper:
    """The stream trimmer; while a stream is over its bounds, admission holds one batch."""
    wait = (core.cfg.consumer.wait_replicas, core.cfg.consumer.wait_timeout_ms)
    budget = feeder.budget if feeder is not None else AdmissionBudget(redis, keys, *wait)
    trimmer = StreamTrimmer(redis, keys, core.cfg.streams)
    return StreamKeeper(trimmer, budget, core.cfg.groups_per_batch)


async def _make_feeder(core: Core, redis: aioredis.Redis, keys: RunKeys) -> TaskFeeder | None:
    cfg = core.cfg
    if cfg.tasks is None:
        return None
    sampler = TaskSampler(load_dataset(cfg.tasks, cfg.data), cfg.seed, cfg.curriculum)
    sampler.restore(core.state.sampler)
    # Tasks and their admission slots are written like commits: on as many replicas.
    wait = (cfg.consumer.wait_replicas, cfg.consumer.wait_timeout_ms)
    producer = Producer(redis, *wait)
    budget = AdmissionBudget(redis, keys, *wait)
    feeder = TaskFeeder(
        redis,
        keys,
        sampler,
        cfg.horizon,
        cfg.group_size,
        limit=cfg.admission_limit,
        producer=producer,
        budget=budget,
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
        adapter=result.adapter,
    )
    await retry_while_unavailable(
        lambda: publish_policy(redis, keys, policy), "publishing the policy version", stop
    )
    elapsed = time.perf_counter() - started
    m.PUSH_SECONDS.observe(elapsed)
    return elapsed
