"""A run's state read from Redis: streams, groups, lag, pending, dead letters.

`farm status` and `python -m broker status` print it; long-running roles call
`refresh_stream_gauges` to export the same numbers as Prometheus gauges.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from broker.admission import AdmissionBudget
from broker.archive import id_key
from broker.codec import decode
from broker.connection import as_str, redis_errors
from broker.errors import BrokerError, DecodeError
from broker.keys import RunKeys
from broker.messages import DeadLetter, PolicyVersion
from broker.metrics import (
    ADMISSION_IN_FLIGHT,
    ADMISSION_LIMIT,
    STREAM_LAG,
    STREAM_LENGTH,
    STREAM_PENDING,
)
from broker.policy import current_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupState:
    name: str
    consumers: int
    pending: int
    lag: int | None  # None when Redis cannot tell (entries deleted inside the range)
    last_delivered_id: str
    pending_per_consumer: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamState:
    name: str
    length: int
    groups: tuple[GroupState, ...]


@dataclass(frozen=True)
class RunState:
    run: str
    streams: tuple[StreamState, ...]
    dead_letters: int
    policy: PolicyVersion | None
    admission_in_flight: int
    admission_limit: int
    latest_dead_letter: str | None = None  # reason of the newest dead letter, if any
    admission_held: str | None = None  # why admission is held at one batch (broker.trim)
    last_eval: dict[str, Any] | None = None  # the newest evaluation's summary (publish_eval)


async def stream_state(redis: aioredis.Redis, stream: str) -> StreamState:
    try:
        length = int(await redis.xlen(stream))
        groups_raw = (
            await redis.xinfo_groups(stream) if length or await redis.exists(stream) else []
        )
    except ResponseError:
        return StreamState(stream, 0, ())
    groups = []
    for g in groups_raw:
        name = as_str(g["name"])
        per_consumer: dict[str, int] = {}
        if int(g["pending"]):
            for c in await redis.xinfo_consumers(stream, name):
                if int(c["pending"]):
                    per_consumer[as_str(c["name"])] = int(c["pending"])
        lag = g.get("lag")
        groups.append(
            GroupState(
                name=name,
                consumers=int(g["consumers"]),
                pending=int(g["pending"]),
                lag=None if lag is None else int(lag),
                last_delivered_id=as_str(g["last-delivered-id"]),
                pending_per_consumer=per_consumer,
            )
        )
    return StreamState(stream, length, tuple(groups))


async def latest_dead_letter(redis: aioredis.Redis, keys: RunKeys) -> str | None:
    """Where the newest dead letter came from and why, or None when there is none."""
    newest: list[tuple[tuple[int, int], dict[bytes, bytes]]] = []
    for stream in keys.all_deadletters:  # one per partition; the newest id wins
        for raw_id, fields in await redis.xrevrange(stream, count=1):
            newest.append((id_key(as_str(raw_id)), fields))
    if not newest:
        return None
    try:
        letter = decode(max(newest, key=lambda e: e[0])[1], expect=DeadLetter)
    except DecodeError as exc:
        return f"unreadable dead letter: {exc}"
    assert isinstance(letter, DeadLetter)
    return f"{letter.source_stream} {letter.entry_id}: {letter.reason}"


async def run_state(redis: aioredis.Redis, keys: RunKeys) -> RunState:
    """The run's state; `RedisUnavailable` or `RedisCommandFailed` when Redis fails."""
    with redis_errors("reading the run's state"):
        streams = tuple(
            [await stream_state(redis, s) for s in (*keys.all_tasks, *keys.all_trajectories)]
        )
        budget = AdmissionBudget(redis, keys)
        dead = sum([int(await redis.xlen(s)) for s in keys.all_deadletters])
        return RunState(
            run=keys.run,
            streams=streams,
            dead_letters=dead,
            policy=await current_policy(redis, keys),
            admission_in_flight=await budget.in_flight(),
            admission_limit=await budget.limit(),
            latest_dead_letter=await latest_dead_letter(redis, keys) if dead else None,
            admission_held=await budget.held(),
            last_eval=_summary(await redis.get(keys.last_eval)),
        )


async def publish_eval(redis: aioredis.Redis, keys: RunKeys, summary: dict[str, Any]) -> None:
    """Keep `summary` (the learner's ``eval`` event: step, weight versions, per-set figures)
    as the run's newest evaluation, for `farm status` and the farm's console. A display
    record, kept as the JSON the learner logs: no program acts on it."""
    with redis_errors("publishing the evaluation summary"):
        await redis.set(keys.last_eval, json.dumps(summary))


def _summary(raw: bytes | str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def eval_lines(summary: dict[str, Any]) -> list[str]:
    """One line per eval set (its per-environment rows left out): mean@k, pass@k, rows and
    the weight versions that answered."""
    versions = summary.get("weight_versions") or [summary.get("version"), summary.get("version")]
    low, high = versions[0], versions[-1]
    weights = f"weights v{low}" if low == high else f"weights v{low}..{high}"
    lines = []
    for name, figures in (summary.get("sets") or {}).items():
        if "/" in name or not isinstance(figures, dict):
            continue
        ks = sorted(int(m[len("pass_at_") :]) for m in figures if m.startswith("pass_at_"))
        k = ks[-1] if ks else 1
        lines.append(
            f"eval {name} at step {summary.get('step')}: mean@{k} "
            f"{figures.get('mean_at_k', 0.0):.3f}, pass@{k} {figures.get(f'pass_at_{k}', 0.0):.3f}"
            f", rows {int(figures.get('rows', 0))}, {weights}"
        )
    return lines


async def refresh_stream_gauges(redis: aioredis.Redis, keys: RunKeys) -> RunState:
    state = await run_state(redis, keys)
    for s in state.streams:
        STREAM_LENGTH.labels(stream=s.name).set(s.length)
        for g in s.groups:
            STREAM_PENDING.labels(stream=s.name, group=g.name).set(g.pending)
            if g.lag is not None:
                STREAM_LAG.labels(stream=s.name, group=g.name).set(g.lag)
    if keys.partitions == 1:
        STREAM_LENGTH.labels(stream=keys.deadletter).set(state.dead_letters)
    else:
        with redis_errors("reading the run's dead letters"):
            for stream in keys.all_deadletters:
                STREAM_LENGTH.labels(stream=stream).set(int(await redis.xlen(stream)))
    ADMISSION_IN_FLIGHT.set(state.admission_in_flight)
    ADMISSION_LIMIT.set(state.admission_limit)
    return state


async def export_stream_gauges(redis: aioredis.Redis, keys: RunKeys, period_s: float = 5.0) -> None:
    """Refresh stream length, lag, pending and admission gauges until cancelled."""
    while True:
        try:
            async with asyncio.timeout(period_s):
                await refresh_stream_gauges(redis, keys)
        except (BrokerError, TimeoutError) as exc:
            log.warning("stream gauges not refreshed: %s", exc)
        await asyncio.sleep(period_s)


def format_state(state: RunState) -> str:
    lines = [f"run {state.run}"]
    policy = state.policy
    lines.append(
        f"  policy version {policy.version} (step {policy.step}, servers {len(policy.servers)})"
        if policy
        else "  policy version: none published"
    )
    lines.append(f"  admission {state.admission_in_flight}/{state.admission_limit} in flight")
    if state.admission_held:
        lines.append(f"    held at one batch: {state.admission_held}")
    lines.append(f"  dead letters {state.dead_letters}")
    if state.latest_dead_letter:
        lines.append(f"    latest: {state.latest_dead_letter}")
    if state.last_eval:
        lines += [f"  last {line}" for line in eval_lines(state.last_eval)]
    for s in state.streams:
        lines.append(f"  stream {s.name}: {s.length} entries")
        for g in s.groups:
            lag = "?" if g.lag is None else str(g.lag)
            lines.append(
                f"    group {g.name}: consumers {g.consumers}, lag {lag}, pending {g.pending}"
            )
            for consumer, n in sorted(g.pending_per_consumer.items()):
                lines.append(f"      {consumer}: {n} pending")
    return "\n".join(lines)
