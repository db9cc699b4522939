"""Datasets users bring: JSONL, Parquet and a `datasets.save_to_disk` directory, read lazily,
each row a task that carries its fields; a bad or oversized row stops the start-up, named."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import Task
from learner.config import CurriculumRules, HorizonSchedule
from learner.datasets import ArrowSource, JsonlSource, load_dataset
from learner.dataspec import DataConfig
from learner.errors import TaskSourceError
from learner.tasks import TaskFeeder, TaskRow, TaskSampler
from tests.conftest import RedisServer
from tests.learner.datafiles import hf_dataset, saved

ROWS = [
    {"question": f"What is {a}+{b}?", "answer": str(a + b), "level": a % 3}
    for a in range(6)
    for b in range(5)
]
FNS = "tests.envs.rewardfns"


def _data(tmp_path: Path, **kwargs: Any) -> DataConfig:
    given = {"prompt_column": "question", "reward": "math", **kwargs}
    return DataConfig(dataset_cache_dir=tmp_path / "cache", **given)


def _parquet(path: Path, rows: list[dict[str, Any]], **kwargs: Any) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_every_row_is_a_dataset_task_carrying_its_fields(tmp_path: Path, kind: str) -> None:
    write = {"jsonl": _jsonl, "parquet": _parquet, "saved": saved}[kind]
    path = write(tmp_path / f"data.{kind}", ROWS)
    source = load_dataset(path, _data(tmp_path))
    assert len(source) == len(ROWS)
    assert isinstance(source, JsonlSource if kind == "jsonl" else ArrowSource)
    spec = json.loads(source[7].env_spec.partition("@")[2])
    assert spec["prompt_column"] == "question" and spec["reward"] == "math"
    assert [source[i].row for i in (0, 7, -1)] == [ROWS[0], ROWS[7], ROWS[-1]]
    assert source.difficulties is None  # rows of a dataset of prompts are all level 0


def test_a_parquet_task_file_names_its_env_per_row(tmp_path: Path) -> None:
    rows = [
        {"env_spec": 'arith@{"split": "heldout"}', "difficulty": 1, "row": {"index": 2}},
        {"env_spec": "toy", "difficulty": 0, "row": None},
    ]
    source = load_dataset(_parquet(tmp_path / "tasks.parquet", rows))
    assert source[0] == TaskRow('arith@{"split": "heldout"}', 1, None, None, {"index": 2})
    assert source[1].row is None and list(source.difficulties) == [1, 0]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rows", "data", "complaint"),
    [
        ([ROWS[0], {"answer": "1"}], {}, "row 1: column 'question' (the prompt) must be"),
        ([ROWS[0], {**ROWS[1], "question": ""}], {}, "row 1: column 'question'"),
        ([ROWS[0], ROWS[1], {**ROWS[2], "answer": None}], {}, "row 2: column 'answer'"),
        ([{**ROWS[0], "blob": "x" * 600}], {"max_row_bytes": 512}, "row 0: the row packs to"),
        (
            [{**ROWS[0], "at": datetime.datetime(2026, 1, 1)}],
            {},
            "row 0: the row cannot travel with its task (msgpack)",
        ),
    ],
)
def test_a_bad_row_stops_the_start_naming_it(
    tmp_path: Path, rows: list[dict[str, Any]], data: dict[str, Any], complaint: str
) -> None:
    """Parquet names the row (from 0), JSONL the line (from 1)."""
    row, problem = complaint.removeprefix("row ").split(": ", 1)
    files = [(_parquet(tmp_path / "d.parquet", rows), f" row {row}: ")]
    if not any(isinstance(v, datetime.datetime) for r in rows for v in r.values()):
        files.append((_jsonl(tmp_path / "d.jsonl", rows), f":{int(row) + 1}: "))
    for path, where in files:
        with pytest.raises(TaskSourceError) as caught:
            load_dataset(path, _data(tmp_path, **data))
        message = str(caught.value)
        assert message.startswith(f"{path}{where}"), message
        assert problem in message, message


def test_a_reward_that_does_not_load_and_a_bad_mapping_stop_the_start(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(TaskSourceError, match="could not be loaded"):
        load_dataset(path, _data(tmp_path, reward=f"{FNS}:missing"))
    with pytest.raises(TaskSourceError, match=r"d.jsonl:1: no env_spec: .* --prompt-column"):
        load_dataset(path)  # a dataset of prompts read without its flags
    with pytest.raises(ValueError, match="needs reward"):
        DataConfig(prompt_column="question")
    with pytest.raises(ValueError, match="not both"):
        DataConfig(prompt_column="q", messages_column="m", reward="exact")


def test_a_dataset_dict_directory_asks_for_one_split(tmp_path: Path) -> None:
    splits = {"train": hf_dataset(ROWS)}  # skips (locally) or fails (CI) without datasets
    import datasets

    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(TaskSourceError, match="several splits \\(train\\): give one split"):
        load_dataset(tmp_path / "dd", _data(tmp_path))
    assert len(load_dataset(tmp_path / "dd" / "train", _data(tmp_path))) == len(ROWS)


def test_parquet_is_converted_once_per_version_of_the_file(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "d.parquet", ROWS, row_group_size=7)
    load_dataset(path, _data(tmp_path))
    [converted] = list((tmp_path / "cache").iterdir())
    stamp = converted.stat().st_mtime_ns
    load_dataset(path, _data(tmp_path, max_row_bytes=4096))  # another check, same conversion
    assert converted.stat().st_mtime_ns == stamp
    _parquet(path, ROWS[:3])  # a new version of the file: converted again
    assert len(load_dataset(path, _data(tmp_path))) == 3
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_the_sampler_draws_a_lazy_dataset_as_it_draws_a_list(tmp_path: Path) -> None:
    lazy = load_dataset(_parquet(tmp_path / "d.parquet", ROWS), _data(tmp_path))
    eager = list(lazy)
    rules = CurriculumRules(difficulty_filter=1, difficulty_defer_steps=5)
    a, b = TaskSampler(lazy, 3, rules), TaskSampler(eager, 3, rules)
    a.observe_groups([(4, [1.0, 1.0]), (9, [0.0])], step=1)
    b.observe_groups([(4, [1.0, 1.0]), (9, [0.0])], step=1)
    drawn = [a.draw_row() for _ in range(50)]
    assert drawn == [b.draw_row() for _ in range(50)]
    assert {i for i, _, _ in drawn}.isdisjoint({4, 9})  # deferred rows are left out


async def test_the_feeder_issues_tasks_that_carry_their_row(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    source = load_dataset(_jsonl(tmp_path / "d.jsonl", ROWS), _data(tmp_path))
    redis = await connect(RedisSettings.from_url(redis_server.url))
    keys = RunKeys("rows")
    sampler = TaskSampler(source, seed=0, rules=CurriculumRules())
    feeder = TaskFeeder(redis, keys, sampler, HorizonSchedule(), group_size=2, limit=4)
    try:
        await feeder.start(0)
        issued = await feeder.top_up(buffered=0, version=0, step=0)
        read = [decode(fields, expect=Task) for _, fields in await redis.xrange(keys.tasks)]
    finally:
        await redis.aclose()
    assert read == issued and len(read) == 4
    for task in read:
        assert isinstance(task, Task) and task.row == ROWS[task.meta["row"]]


def test_a_task_file_beside_a_dataset_of_prompts_is_read_as_a_task_file(tmp_path: Path) -> None:
    """One mapping for every file of a run: a file whose rows name their env_spec (an arith
    held-out set listed by row) is still a task file when the prompt flags are given."""
    held = tmp_path / "held.jsonl"
    held.write_text('{"env_spec": "arith", "row": {"index": 3}}\n')
    assert load_dataset(held, _data(tmp_path))[0] == TaskRow("arith", row={"index": 3})


def test_a_filtered_dataset_of_prompts_reads_back_with_the_same_flags(tmp_path: Path) -> None:
    """`learner filter` writes a kept row of a dataset of prompts as that row plus a
    `pass_rate` column (not a task line), so the output trains with the same flags."""
    from broker.messages import Trajectory, TrajectoryGroup, Turn
    from learner.evaluate import kept_rows

    data = _data(tmp_path)
    rows = load_dataset(_jsonl(tmp_path / "d.jsonl", ROWS[:3]), data)

    def group(index: int, rewards: list[float]) -> TrajectoryGroup:
        turns = [Turn([1], [2], [-0.1], 0, r, True, False) for r in rewards]
        task = Task(f"t{index}", rows[index].env_spec, len(rewards), index, 0)
        return TrajectoryGroup(
            task.task_id, task, tuple(Trajectory((t,), "terminated") for t in turns), "w"
        )

    groups = {0: group(0, [1.0, 0.0]), 1: group(1, [1.0, 1.0]), 2: group(2, [0.0, 0.0])}
    kept, unscored = kept_rows(rows, groups, (0.1, 0.9), 0.5, data.env_spec())
    assert (kept, unscored) == ([{**ROWS[0], "pass_rate": 0.5}], 0)
    again = load_dataset(_jsonl(tmp_path / "kept.jsonl", kept), data)
    assert again[0].row == {**ROWS[0], "pass_rate": 0.5}
