"""Every wire message round-trips through the codec; bad bytes raise DecodeError."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.codec import decode, encode
from broker.errors import DecodeError
from broker.messages import (
    DeadLetter,
    ErrorCategory,
    EvalMark,
    FinishReason,
    PolicyVersion,
    Sampling,
    Task,
    Trajectory,
    TrajectoryGroup,
    Truncation,
    Turn,
)

text = st.text(max_size=20)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
json_like = st.dictionaries(
    st.text(max_size=8), st.one_of(ints, text, st.booleans(), st.none()), max_size=4
)

tasks = st.builds(
    Task,
    task_id=st.text(min_size=1, max_size=20),
    env_spec=text,
    group_size=st.integers(1, 64),
    seed=ints,
    policy_version=st.integers(0, 2**40),
    issued_at=floats,
    max_turns=st.none() | st.integers(1, 100),
    meta=json_like,
)


samplings = st.builds(
    Sampling,
    temperature=st.floats(0, 10, width=32),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0, 1.0, width=32, exclude_min=True),
    min_p=st.floats(0.0, 1.0, width=32),
    allowed_token_ids=st.none()
    | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=20).map(np.array),
)


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    n = draw(st.integers(0, 50))
    sampling = draw(samplings)
    drawn = (
        ints
        if sampling.allowed_token_ids is None
        else st.sampled_from(sampling.allowed_token_ids.tolist())
    )
    return Turn(
        prompt_ids=np.array(draw(st.lists(ints, max_size=50)), dtype=np.int32),
        completion_ids=np.array(draw(st.lists(drawn, min_size=n, max_size=n)), dtype=np.int32),
        logprobs=np.array(
            draw(st.lists(st.floats(-100, 0, width=32), min_size=n, max_size=n)), dtype=np.float32
        ),
        weight_version=draw(st.integers(0, 2**40)),
        reward=draw(floats),
        terminated=draw(st.booleans()),
        truncated=draw(st.booleans()),
        sampling=sampling,
        cut=draw(st.booleans()),
    )


trajectories = st.builds(
    Trajectory,
    turns=st.lists(turns(), max_size=4).map(tuple),
    finish_reason=st.sampled_from([FinishReason.TERMINATED, FinishReason.ERROR]),
    error=st.sampled_from(list(ErrorCategory)),
    error_detail=text,
    sample_index=st.integers(0, 1000),
    timings=st.dictionaries(st.text(max_size=8), floats, max_size=3),
)
truncated = st.builds(
    Trajectory,
    turns=st.lists(turns(), max_size=2).map(tuple),
    finish_reason=st.just(FinishReason.TRUNCATED),
    truncation=st.sampled_from(list(Truncation)),
)
groups = st.builds(
    TrajectoryGroup,
    group_id=text,
    task=tasks,
    trajectories=st.lists(trajectories | truncated, max_size=3).map(tuple),
    worker_id=text,
    created_at=floats,
)
policies = st.builds(
    PolicyVersion,
    version=st.integers(0, 2**40),
    step=st.integers(0, 2**40),
    servers=st.lists(text, max_size=3).map(tuple),
    weights_path=text,
    created_at=floats,
    adapter=text,
)
letters = st.builds(
    DeadLetter,
    source_stream=text,
    entry_id=text,
    reason=text,
    fields=st.dictionaries(st.binary(max_size=4), st.binary(max_size=16), max_size=3),
    deliveries=st.integers(0, 100),
    consumer=text,
    created_at=floats,
)


@settings(max_examples=60, deadline=None)
@given(st.one_of(tasks, groups, policies, letters))
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


def test_arrays_decode_as_zero_copy_views():
    turn = Turn([1, 2], [3, 4, 5], [-0.5, -1.0, -2.0], 3, 1.0, True, False)
    traj = Trajectory((turn,), "terminated")
    group = TrajectoryGroup("g", Task("g", "toy@{}", 1, 0, 0), (traj,), "w")
    fields = encode(group)
    out = decode(fields).trajectories[0].turns[0]
    assert out.completion_ids.dtype == np.dtype("<i4")
    assert out.logprobs.dtype == np.dtype("<f4")
    assert not out.completion_ids.flags.owndata  # a view over the received buffer
    assert out.completion_ids.tolist() == [3, 4, 5]


def test_strided_and_big_endian_arrays_round_trip():
    ids = np.arange(12, dtype="<i4")[::3]  # a strided view: not contiguous
    turn = Turn([7], ids, np.full(4, -0.25, dtype=">f4"), 0, 0.0, True, False)
    out = decode(
        encode(
            TrajectoryGroup(
                "g", Task("g", "toy@{}", 1, 0, 0), (Trajectory((turn,), "terminated"),), "w"
            )
        )
    )
    got = out.trajectories[0].turns[0]
    assert got.completion_ids.tolist() == [0, 3, 6, 9]
    assert got.logprobs.tolist() == [-0.25] * 4


@given(st.dictionaries(st.binary(max_size=3), st.binary(max_size=40), max_size=4))
def test_arbitrary_fields_never_raise_anything_but_decode_error(fields):
    try:
        decode(fields)
    except DecodeError:
        pass


def test_logprob_count_must_match_tokens():
    with pytest.raises(ValueError, match="logprobs"):
        Turn([1], [2, 3], [-1.0], 0, 0.0, False, False)


def _one_turn_group(turn: Turn) -> TrajectoryGroup:
    trajectory = Trajectory((turn,), FinishReason.TERMINATED)
    return TrajectoryGroup("g", Task("g", "toy@{}", 1, 0, 0), (trajectory,), "w")


def _with_turn_fields(fields: dict[bytes, bytes], version: bytes, turn_fields: list) -> dict:
    body = msgpack.unpackb(fields[b"b"], raw=False)
    body[2][0][0][0] = turn_fields
    if version not in (b"5", b"6"):  # group schemas 1-4 carried task schema 1 (8 fields)
        body[1] = body[1][:8]
    return {b"k": b"group", b"v": version, b"b": msgpack.packb(body, use_bin_type=True)}


def test_schema_4_records_the_whole_sampled_distribution() -> None:
    sampling = Sampling(0.7, top_k=5, top_p=0.9, min_p=0.05, allowed_token_ids=[9, 3, 3, 4])
    turn = Turn([1, 2], [3], [-0.5], 4, 1.0, True, False, sampling=sampling)
    fields = encode(_one_turn_group(dataclasses.replace(turn, cut=True)))
    assert fields[b"v"] == b"6"
    assert decode(fields).trajectories[0].turns[0].cut  # type: ignore[union-attr]
    decoded = decode(fields).trajectories[0].turns[0].sampling  # type: ignore[union-attr]
    assert decoded == sampling and decoded.allowed_token_ids.tolist() == [3, 4, 9]
    assert (decoded.top_k, decoded.top_p, decoded.min_p) == (5, np.float32(0.9), np.float32(0.05))
    plain = encode(_one_turn_group(Turn([1], [3], [-0.5], 4, 1.0, True, False)))
    assert decode(plain).trajectories[0].turns[0].sampling == Sampling()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([-1.0, 0, 1.0, 0.0, None], "temperature"),
        ([1.0, -3, 1.0, 0.0, None], "top_k"),
        ([1.0, 0, 0.0, 0.0, None], "top_p"),
        ([1.0, 0, 1.0, 1.5, None], "min_p"),
        ([1.0, 0, 1.0, 0.0, b""], "allowed_token_ids"),
        ([1.0, 0, 1.0, 0.0, b"\xff\xff\xff\xff"], "allowed_token_ids"),
        ([1.0, 0, 1.0], "unpack"),
        ([1.0, 0, 1.0, 0.0, np.array([4, 5], "<i4").tobytes()], "outside the allowed set"),
    ],
)
def test_bad_sampling_records_fail_to_decode(bad: list, reason: str) -> None:
    fields = encode(_one_turn_group(Turn([1, 2], [3], [-0.5], 4, 1.0, True, False)))
    turn = msgpack.unpackb(fields[b"b"], raw=False)[2][0][0][0]
    with pytest.raises(DecodeError, match=reason):
        decode(_with_turn_fields(fields, b"6", [*turn[:8], bad, False, 0]))


def test_older_schemas_decode_with_what_they_recorded() -> None:
    """Schema 3 recorded the temperature alone, schema 2 nothing: both still decode."""
    fields = encode(_one_turn_group(Turn([1, 2], [3], [-0.5], 4, 1.0, True, False)))
    turn = msgpack.unpackb(fields[b"b"], raw=False)[2][0][0][0]
    v3 = decode(_with_turn_fields(fields, b"3", [*turn[:8], 0.7]))  # 9 fields: no length cut
    assert v3.trajectories[0].turns[0].sampling == Sampling(0.7)  # type: ignore[union-attr]
    assert not v3.trajectories[0].turns[0].cut  # type: ignore[union-attr]
    v2 = decode(_with_turn_fields(fields, b"2", turn[:7]))  # a schema-2 writer wrote 7 fields
    assert isinstance(v2, TrajectoryGroup)
    assert v2.trajectories[0].turns[0].sampling == Sampling()
    assert np.array_equal(v2.trajectories[0].turns[0].completion_ids, [3])
    with pytest.raises(DecodeError, match="7 or 8 fields"):  # a schema-4 turn under a 2 tag
        decode(_with_turn_fields(fields, b"2", turn))
    v4 = decode(_with_turn_fields(fields, b"4", turn[:10]))  # schema 4: task schema 1 inside
    assert v4.task.eval is None and v4.task.temperature is None  # type: ignore[union-attr]
    v5 = decode(_with_turn_fields(fields, b"5", turn[:10]))  # schema 5: no reasoning count
    assert v5.trajectories[0].turns[0].reasoning_tokens == 0  # type: ignore[union-attr]
    with pytest.raises(DecodeError, match="10 fields"):  # a schema-6 turn under a 5 tag
        decode(_with_turn_fields(fields, b"5", turn))
    with pytest.raises(DecodeError, match="temperature"):
        decode(_with_turn_fields(fields, b"3", [*turn[:8], -1.0]))
    with pytest.raises(DecodeError, match="unsupported schema version 7"):
        decode({**fields, b"v": b"7"})


def test_schema_6_records_how_many_completion_tokens_are_reasoning() -> None:
    turn = Turn([1, 2], [7, 8, 9], [-0.5, -0.1, -0.2], 4, 1.0, True, False, reasoning_tokens=2)
    fields = encode(_one_turn_group(turn))
    assert fields[b"v"] == b"6"
    assert decode(fields).trajectories[0].turns[0] == turn  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="4 reasoning tokens of 3"):
        dataclasses.replace(turn, reasoning_tokens=4)
    body = msgpack.unpackb(fields[b"b"], raw=False)[2][0][0][0]
    with pytest.raises(DecodeError, match="reasoning tokens"):
        decode(_with_turn_fields(fields, b"6", [*body[:10], 5]))


def test_group_schema_1_entries_still_decode() -> None:
    """Schema 1 spelled the truncation cause inside the reason ("truncated:context")."""
    import msgpack

    task = ["t1", "toy@{}", 2, 7, 0, 1.0, None, {}]
    turn = [b"\x01\x00\x00\x00", b"\x02\x00\x00\x00", b"\x00\x00\x80\xbf", 0, 1.0, False, True]
    v1 = [
        [[turn], "truncated:context", "none", "", 0, {"total": 1.0}],
        [[], "error", "inference", "down", 1, {}],
    ]
    body = msgpack.packb(["t1", task, v1, "w", 2.0], use_bin_type=True)
    group = decode({b"k": b"group", b"v": b"1", b"b": body}, expect=TrajectoryGroup)
    assert isinstance(group, TrajectoryGroup)
    cut, failed = group.trajectories
    assert (cut.finish_reason, cut.truncation) == (FinishReason.TRUNCATED, Truncation.CONTEXT)
    assert cut.outcome == "truncated:context" and cut.turns[0].truncated
    assert (failed.finish_reason, failed.truncation) == (FinishReason.ERROR, None)
    assert failed.error is ErrorCategory.INFERENCE
    assert encode(group)[b"v"] == b"6"  # re-encoded in the current schema
    with pytest.raises(DecodeError, match="unsupported schema version 7"):
        decode({b"k": b"group", b"v": b"7", b"b": body})


def test_eval_tasks_are_marked_on_the_wire_and_task_schema_1_still_decodes() -> None:
    mark = EvalMark("held-out", "round-3", 7)
    task = Task("t1", "toy@{}", 4, 9, 2, eval=mark, temperature=0.0, max_tokens=5)
    fields = encode(task)
    assert fields[b"v"] == b"3"
    back = decode(fields, expect=Task)
    assert back == task and back.is_eval  # type: ignore[union-attr]
    old = msgpack.packb(["t0", "toy@{}", 2, 7, 0, 1.0, None, {}], use_bin_type=True)
    v1 = decode({b"k": b"task", b"v": b"1", b"b": old}, expect=Task)
    assert isinstance(v1, Task) and not v1.is_eval and v1.temperature is None
    with pytest.raises(DecodeError, match="11 fields"):  # a schema-1 body under a 2 tag
        decode({b"k": b"task", b"v": b"2", b"b": old})
    with pytest.raises(DecodeError, match="12 fields"):  # a schema-1 body under a 3 tag
        decode({b"k": b"task", b"v": b"3", b"b": old})
    with pytest.raises(ValueError, match="round id"):
        EvalMark("held-out", "", 0)
    with pytest.raises(ValueError, match="max_tokens"):
        Task("t1", "toy@{}", 4, 9, 2, max_tokens=0)


def test_a_truncation_cause_goes_only_with_truncated() -> None:
    with pytest.raises(ValueError, match="truncation cause"):
        Trajectory((), FinishReason.TRUNCATED)
    with pytest.raises(ValueError, match="truncation cause"):
        Trajectory((), FinishReason.TERMINATED, truncation=Truncation.ENV)
    with pytest.raises(ValueError):
        Trajectory((), "truncated:context")  # the old string protocol is refused


def test_policy_versions_name_their_adapter_and_schema_1_still_decodes() -> None:
    lora = PolicyVersion(3, 7, ("http://a",), "/w/run-v3", 1.5, adapter="run-v3")
    assert decode(encode(lora)) == lora
    old = msgpack.packb([2, 5, ["http://a"], "/w/v2", 1.0], use_bin_type=True)
    v1 = decode({b"k": b"policy", b"v": b"1", b"b": old}, expect=PolicyVersion)
    assert v1 == PolicyVersion(2, 5, ("http://a",), "/w/v2", 1.0)
    assert v1.adapter == ""  # schema 1 always meant full weights
    assert encode(v1)[b"v"] == b"2"
    with pytest.raises(DecodeError, match="6 fields"):  # a schema-1 body under a 2 tag
        decode({b"k": b"policy", b"v": b"2", b"b": old})


rows = st.none() | st.dictionaries(
    st.text(max_size=8),
    st.one_of(ints, text, floats, st.booleans(), st.none(), st.lists(text, max_size=3)),
    max_size=5,
)


@settings(max_examples=40, deadline=None)
@given(tasks, rows)
def test_a_tasks_row_travels_with_it(task: Task, row: dict[str, object] | None) -> None:
    """Task schema 3 carries the dataset row; the group built from the task carries the task
    in schema 2, without the row (the learner holds its dataset), and still decodes equal."""
    with_row = dataclasses.replace(task, row=row)
    assert decode(encode(with_row), expect=Task) == with_row
    group = TrajectoryGroup("g", with_row, (), "w")
    assert decode(encode(group)).task == task  # type: ignore[union-attr]


def test_task_schema_2_still_decodes_and_a_bad_row_is_refused() -> None:
    v2 = ["t2", "toy@{}", 2, 7, 0, 1.0, None, {}, ["s", "r", 3], 0.0, 4]
    back = decode({b"k": b"task", b"v": b"2", b"b": msgpack.packb(v2)}, expect=Task)
    assert isinstance(back, Task) and back.row is None and back.eval == EvalMark("s", "r", 3)
    bad = msgpack.packb([*v2, ["not", "a", "map"]])
    with pytest.raises(DecodeError, match="row must be a map"):
        decode({b"k": b"task", b"v": b"3", b"b": bad})
