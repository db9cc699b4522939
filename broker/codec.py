"""msgpack codec for the wire messages.

A stream entry has three fields: ``k`` (the message kind), ``v`` (its schema
version) and ``b`` (the msgpack body). Arrays travel as raw little-endian bytes
and decode through ``numpy.frombuffer``, which views the received buffer instead
of copying it. Every failure to decode raises ``DecodeError`` with a reason
suitable for a dead letter; nothing else escapes ``decode``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from broker.errors import DecodeError
from broker.messages import (
    DEFAULT_SAMPLING,
    DeadLetter,
    ErrorCategory,
    EvalMark,
    FinishReason,
    Message,
    PolicyVersion,
    Sampling,
    Task,
    Trajectory,
    TrajectoryGroup,
    Truncation,
    Turn,
)

FIELD_KIND = b"k"
FIELD_VERSION = b"v"
FIELD_BODY = b"b"


def _task_to(t: Task) -> list[Any]:
    return [*_task_to_v2(t), t.row]


def _task_to_v2(t: Task) -> list[Any]:
    """Task schema 2: what a group carries (its task without the row)."""
    mark = None if t.eval is None else [t.eval.set_name, t.eval.round_id, t.eval.row]
    return [
        t.task_id,
        t.env_spec,
        t.group_size,
        t.seed,
        t.policy_version,
        t.issued_at,
        t.max_turns,
        t.meta,
        mark,
        t.temperature,
        t.max_tokens,
    ]


def _task_from(v: list[Any]) -> Task:
    if len(v) != 12:
        raise ValueError(f"a schema-3 task has 12 fields, got {len(v)}")
    row = v[11]
    if row is not None and not isinstance(row, dict):
        raise ValueError(f"a task's row must be a map, got {type(row).__name__}")
    return dataclasses.replace(_task_from_v2(v[:11]), row=row)


def _task_from_v2(v: list[Any]) -> Task:
    if len(v) != 11:
        raise ValueError(f"a schema-2 task has 11 fields, got {len(v)}")
    mark, temperature, max_tokens = v[8:]
    return dataclasses.replace(
        _task_from_v1(v[:8]),
        eval=None if mark is None else EvalMark(str(mark[0]), str(mark[1]), int(mark[2])),
        temperature=temperature,
        max_tokens=max_tokens,
    )


def _task_from_v1(v: list[Any]) -> Task:
    """Task schema 1 (and the task inside group schemas 1-4): no eval mark, no sampling."""
    task_id, env_spec, group_size, seed, policy_version, issued_at, max_turns, meta = v
    return Task(
        task_id=task_id,
        env_spec=env_spec,
        group_size=group_size,
        seed=seed,
        policy_version=policy_version,
        issued_at=issued_at,
        max_turns=max_turns,
        meta=meta,
    )


def _bin(arr: np.ndarray) -> memoryview:
    # msgpack packs a contiguous buffer as bin in one copy; tobytes() would add another
    # (10x slower for a 2 MB array: fresh allocation and page faults).
    return memoryview(np.ascontiguousarray(arr))


def _sampling_to(s: Sampling) -> list[Any] | None:
    if s is DEFAULT_SAMPLING or s == DEFAULT_SAMPLING:
        return None  # the common case costs one byte
    ids = None if s.allowed_token_ids is None else _bin(s.allowed_token_ids)
    return [s.temperature, s.top_k, s.top_p, s.min_p, ids]


# Decoded sampling records, interned: the turns of a run share a handful of distributions.
_SAMPLINGS: dict[tuple[Any, ...], Sampling] = {}


def _sampling_from(v: list[Any] | None) -> Sampling:
    if v is None:
        return DEFAULT_SAMPLING
    temperature, top_k, top_p, min_p, ids = v
    key = (
        float(temperature),
        int(top_k),
        float(top_p),
        float(min_p),
        None if ids is None else bytes(ids),
    )
    found = _SAMPLINGS.get(key)
    if found is None:
        allowed = None if ids is None else np.frombuffer(ids, dtype="<i4")
        found = Sampling(*key[:4], allowed_token_ids=allowed)  # validates every field
        if len(_SAMPLINGS) < 4096:  # bounded: a hostile producer cannot grow it without end
            _SAMPLINGS[key] = found
    return found


def _turn_to(t: Turn) -> list[Any]:
    return [
        _bin(t.prompt_ids),
        _bin(t.completion_ids),
        _bin(t.logprobs),
        t.weight_version,
        t.reward,
        t.terminated,
        t.truncated,
        t.segment_start,
        _sampling_to(t.sampling),
        t.cut,
        t.reasoning_tokens,
    ]


def _turn_from(v: list[Any], sampling_from: Any = _sampling_from) -> Turn:
    # Hot path of every consumer: build the frozen Turn without __post_init__'s
    # asarray round trips, keeping its checks (frombuffer already gives int32/float32).
    prompt, completion, logprobs, weight_version, reward, terminated, truncated = v[:7]
    segment_start, sampling, cut, reasoning = v[7:]  # schema 6 has eleven fields
    completion_ids = np.frombuffer(completion, dtype="<i4")
    lp = np.frombuffer(logprobs, dtype="<f4")
    if len(lp) != len(completion_ids):
        raise ValueError(f"{len(lp)} logprobs for {len(completion_ids)} completion tokens")
    drawn_from = sampling_from(sampling)
    drawn_from.check_drawn(completion_ids)
    if not 0 <= reasoning <= len(completion_ids):
        raise ValueError(f"{reasoning} reasoning tokens of {len(completion_ids)} completion tokens")
    turn = object.__new__(Turn)
    turn.__dict__.update(
        prompt_ids=np.frombuffer(prompt, dtype="<i4"),
        completion_ids=completion_ids,
        logprobs=lp,
        weight_version=int(weight_version),
        reward=float(reward),
        terminated=bool(terminated),
        truncated=bool(truncated),
        segment_start=bool(segment_start),
        sampling=drawn_from,
        cut=bool(cut),
        reasoning_tokens=int(reasoning),
    )
    return turn


def _turn_from_v5(v: list[Any]) -> Turn:
    if len(v) != 10:
        raise ValueError(f"a schema-4/5 turn has 10 fields, got {len(v)}")
    return _turn_from([*v, 0])  # reasoning went unrecorded


def _temperature_only(temp: Any) -> Sampling:
    """Schema 3 recorded the temperature alone (the allowed-token mask went unrecorded)."""
    t = float(temp)
    return DEFAULT_SAMPLING if t == 1.0 else _sampling_from([t, 0, 1.0, 0.0, None])


def _turn_from_v3(v: list[Any]) -> Turn:
    if len(v) != 9:
        raise ValueError(f"a schema-3 turn has 9 fields, got {len(v)}")
    return _turn_from([*v, False, 0], _temperature_only)  # length cuts went unrecorded


def _turn_from_v2(v: list[Any]) -> Turn:
    # Schemas 1 and 2 had no temperature: their logprobs were the raw model's (temperature 1);
    # segment_start came later in schema 2 as an optional eighth field.
    if len(v) not in (7, 8):
        raise ValueError(f"a schema-1/2 turn has 7 or 8 fields, got {len(v)}")
    return _turn_from([*v[:7], v[7] if len(v) > 7 else False, None, False, 0])


_CATEGORIES = {c.value: c for c in ErrorCategory}
_FINISH = {f.value: f for f in FinishReason}
_TRUNCATION = {t.value: t for t in Truncation}


def _traj_to(t: Trajectory) -> list[Any]:
    return [
        [_turn_to(turn) for turn in t.turns],
        t.finish_reason.value,
        None if t.truncation is None else t.truncation.value,
        t.error.value,
        t.error_detail,
        t.sample_index,
        t.timings,
    ]


def _traj_from(v: list[Any], turn_from: Any = _turn_from) -> Trajectory:
    # Hot path, like _turn_from: enum members by dict lookup (an unknown value raises
    # KeyError, which decode reports) and __post_init__'s one check kept here.
    turns, finish_reason, truncation, error, error_detail, sample_index, timings = v
    finish = _FINISH[finish_reason]
    cause = None if truncation is None else _TRUNCATION[truncation]
    if (finish is FinishReason.TRUNCATED) != (cause is not None):
        raise ValueError("a truncation cause goes with finish_reason TRUNCATED, and only then")
    traj = object.__new__(Trajectory)
    traj.__dict__.update(
        turns=tuple([turn_from(t) for t in turns]),
        finish_reason=finish,
        error=_CATEGORIES[error],
        error_detail=error_detail,
        sample_index=sample_index,
        timings=timings,
        truncation=cause,
    )
    return traj


def _traj_from_v1(v: list[Any]) -> Trajectory:
    """Group schema 1 spelled the cause inside the reason: "truncated:context"."""
    turns, reason, error, error_detail, sample_index, timings = v
    finish, _, cause = str(reason).partition(":")
    row = [turns, finish, cause or None, error, error_detail, sample_index, timings]
    return _traj_from(row, _turn_from_v2)


def _group_to(g: TrajectoryGroup) -> list[Any]:
    return [
        g.group_id,
        _task_to_v2(g.task),  # without the row: the trajectories stream stays lean
        [_traj_to(t) for t in g.trajectories],
        g.worker_id,
        g.created_at,
    ]


def _group_from(
    v: list[Any], traj_from: Any = _traj_from, task_from: Any = _task_from_v2
) -> TrajectoryGroup:
    group_id, task, trajectories, worker_id, created_at = v
    return TrajectoryGroup(
        group_id=group_id,
        task=task_from(task),
        trajectories=tuple([traj_from(t) for t in trajectories]),
        worker_id=worker_id,
        created_at=created_at,
    )


def _group_from_v1(v: list[Any]) -> TrajectoryGroup:
    return _group_from(v, _traj_from_v1, _task_from_v1)


def _policy_to(p: PolicyVersion) -> list[Any]:
    return [p.version, p.step, list(p.servers), p.weights_path, p.created_at, p.adapter]


def _policy_from(v: list[Any]) -> PolicyVersion:
    if len(v) != 6:
        raise ValueError(f"a schema-2 policy version has 6 fields, got {len(v)}")
    return _policy_from_v1(v[:5], adapter=v[5])


def _policy_from_v1(v: list[Any], adapter: str = "") -> PolicyVersion:
    """Schema 1 had no adapter: it always meant full weights."""
    version, step, servers, weights_path, created_at = v
    return PolicyVersion(
        version=version,
        step=step,
        servers=tuple(servers),
        weights_path=weights_path,
        created_at=created_at,
        adapter=adapter,
    )


def _dead_to(d: DeadLetter) -> list[Any]:
    return [
        d.source_stream,
        d.entry_id,
        d.reason,
        d.fields,
        d.deliveries,
        d.consumer,
        d.created_at,
    ]


def _dead_from(v: list[Any]) -> DeadLetter:
    source_stream, entry_id, reason, fields, deliveries, consumer, created_at = v
    return DeadLetter(
        source_stream=source_stream,
        entry_id=entry_id,
        reason=reason,
        fields=dict(fields),
        deliveries=deliveries,
        consumer=consumer,
        created_at=created_at,
    )


# kind -> (type, version, encoder, decoder)
_CODECS: dict[str, tuple[type, int, Any, Any]] = {
    Task.KIND: (Task, Task.VERSION, _task_to, _task_from),
    TrajectoryGroup.KIND: (TrajectoryGroup, TrajectoryGroup.VERSION, _group_to, _group_from),
    PolicyVersion.KIND: (PolicyVersion, PolicyVersion.VERSION, _policy_to, _policy_from),
    DeadLetter.KIND: (DeadLetter, DeadLetter.VERSION, _dead_to, _dead_from),
}


# (kind, older schema version) -> decoder: entries written before a bump still decode.
_OLDER: dict[tuple[str, int], Any] = {
    (Task.KIND, 1): _task_from_v1,
    (Task.KIND, 2): _task_from_v2,
    (TrajectoryGroup.KIND, 1): _group_from_v1,
    (TrajectoryGroup.KIND, 2): lambda v: _group_from(
        v, lambda t: _traj_from(t, _turn_from_v2), _task_from_v1
    ),
    (TrajectoryGroup.KIND, 3): lambda v: _group_from(
        v, lambda t: _traj_from(t, _turn_from_v3), _task_from_v1
    ),
    (TrajectoryGroup.KIND, 4): lambda v: _group_from(
        v, lambda t: _traj_from(t, _turn_from_v5), _task_from_v1
    ),
    (TrajectoryGroup.KIND, 5): lambda v: _group_from(v, lambda t: _traj_from(t, _turn_from_v5)),
    (PolicyVersion.KIND, 1): _policy_from_v1,
}


def encode(message: Message) -> dict[bytes, bytes]:
    """Encode a message into stream-entry fields."""
    kind = type(message).KIND
    _, version, to_wire, _ = _CODECS[kind]
    body = msgpack.packb(to_wire(message), use_bin_type=True)
    return {FIELD_KIND: kind.encode(), FIELD_VERSION: str(version).encode(), FIELD_BODY: body}


def decode(fields: Mapping[bytes, bytes], expect: type | None = None) -> Message:
    """Decode stream-entry fields; raise DecodeError with a reason on any problem."""
    try:
        kind = fields[FIELD_KIND].decode()
        version = int(fields[FIELD_VERSION])
        body = fields[FIELD_BODY]
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError, TypeError) as exc:
        raise DecodeError(f"missing or malformed envelope fields: {exc!r}") from exc
    entry = _CODECS.get(kind)
    if entry is None:
        raise DecodeError(f"unknown message kind {kind!r}")
    cls, known_version, _, from_wire = entry
    if version != known_version:
        from_wire = _OLDER.get((kind, version))
        if from_wire is None:
            raise DecodeError(
                f"unsupported schema version {version} for {kind!r} (know {known_version})"
            )
    if expect is not None and cls is not expect:
        raise DecodeError(f"expected {expect.KIND!r}, got {kind!r}")  # type: ignore[attr-defined]
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=False)
        return from_wire(raw)
    except Exception as exc:  # any malformed body: msgpack, shape, type or value errors
        raise DecodeError(f"undecodable {kind!r} body: {type(exc).__name__}: {exc}") from exc
