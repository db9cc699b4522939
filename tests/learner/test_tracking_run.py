"""A real learner run with ``--tracker tensorboard --tracker wandb``, read back.

The test publishes groups straight into a real Redis (no workers) and runs `python -m
learner` on the tiny model for two steps, with a batch in between that trains nothing.
TensorBoard's event files are read with tensorboard's own EventAccumulator, the offline
W&B run with wandb's own protobuf records (tests/learner/wandb_records.py); every step
scalar must equal the learner's JSON step line, the config must be the masked one, and
each step must have its sample table with the expected columns and rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.messages import ErrorCategory, TrajectoryGroup
from broker.producer import Producer
from learner.tracking.base import SECTION_OF
from learner.tracking.samples import COLUMNS
from tests.conftest import RedisServer, free_port
from tests.learner import wandb_records
from tests.learner.factories import make_group
from tests.learner.farm import step_records

RUN = "tracked"
KEYS = RunKeys(RUN)


def failed(group_id: str) -> TrajectoryGroup:
    group = make_group(group_id, [0.0, 1.0])
    broken = (
        dataclasses.replace(group.trajectories[0], error=ErrorCategory.SANDBOX),
        *group.trajectories[1:],
    )
    return dataclasses.replace(group, trajectories=broken)


async def publish(url: str) -> None:
    groups = [
        make_group("a", [0.0, 1.0], turns=2),
        failed("b"),  # step 1: b failed (sandbox)
        make_group("z1", [1.0, 1.0]),
        make_group("z2", [0.0, 0.0]),  # zero variance: skipped
        make_group("c", [1.0, 0.0]),
        make_group("d", [0.5, 0.0]),  # step 2
    ]
    redis = await connect(RedisSettings.from_url(url))
    await Producer(redis).publish(KEYS.trajectories(), groups)
    await redis.aclose()


Run = tuple[Path, list[dict[str, object]], str]  # tracker dir, step lines, stderr


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    work = tmp_path_factory.mktemp("tracked")
    server = RedisServer(free_port(), work, appendonly=False)
    server.start()
    try:
        asyncio.run(publish(server.url))
        yield server.url, work
    finally:
        server.stop()


def run_learner(work: Path, model: Path, url: str, *extra: str) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(work)  # no ~/.netrc with a key: W&B must go offline by itself
    cmd = [
        sys.executable,
        "-m",
        "learner",
        "--model",
        str(model),
        "--redis-url",
        url,
        "--run",
        RUN,
        "--groups-per-batch",
        "2",
        "--learning-rate",
        "1e-3",
        "--tracker-dir",
        str(work / "runs"),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return work / "runs", step_records(done.stderr), done.stderr


@pytest.fixture(scope="module")
def tracked_run(published: tuple[str, Path], tiny_model_dir: Path) -> Run:
    url, work = published
    return run_learner(
        work,
        tiny_model_dir,
        url,
        "--max-steps",
        "2",
        "--inference-api-key",
        "s3cret",
        "--tracker",
        "tensorboard",
        "--tracker",
        "wandb",
        "--tracker-sample-interval",
        "1",
        "--tracker-sample-rows",
        "3",
    )


def expected_scalars(record: dict[str, object]) -> dict[str, float]:
    out = {
        f"{SECTION_OF.get(k, 'batch')}/{k}": float(v)  # type: ignore[arg-type]
        for k, v in record.items()
        if k not in ("event", "step")
    }
    busy = sum(float(record[k]) for k in ("wait_s", "compute_s", "push_s"))  # type: ignore[arg-type]
    out["throughput/wait_share"] = float(record["wait_s"]) / busy  # type: ignore[arg-type]
    return out


@pytest.mark.slow
def test_tensorboard_holds_every_step_record_config_and_samples(tracked_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs, steps, _ = tracked_run
    assert [s["step"] for s in steps] == [1, 2]
    events = EventAccumulator(str(runs / "tensorboard" / RUN), size_guidance={"tensors": 0})
    events.Reload()
    for record in steps:
        for name, value in expected_scalars(record).items():
            logged = {e.step: e.value for e in events.Scalars(name)}
            assert logged[record["step"]] == np.float32(value), name  # TB stores float32
    skipped = events.Scalars("batch/skipped_batches")
    assert [(e.step, e.value) for e in skipped] == [(1, 1.0)]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"run": "tracked"' in config and '"inference_api_key": "**********"' in config
    assert "s3cret" not in config
    tables = {
        e.step: e.tensor_proto.string_val[0].decode()
        for e in events.Tensors("samples/text_summary")
    }
    assert sorted(tables) == [1, 2]
    lines = tables[1].split("\n")
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(lines) == 2 + 3  # header, rule, three rows
    assert "| b | 0 | toy@{} |" in tables[1] and "| sandbox |" in tables[1]


@pytest.mark.slow
def test_wandb_offline_run_holds_every_step_record_config_and_samples(tracked_run) -> None:
    runs, steps, stderr = tracked_run
    assert "W&B runs offline" in stderr
    (run_dir,) = (runs / "wandb").glob("offline-run-*")
    rows = wandb_records.history(run_dir)
    for record in steps:
        row = rows[record["step"]]  # type: ignore[index]
        for name, value in expected_scalars(record).items():
            assert row[name] == value, name  # the same float64 the step line shows
        assert row["samples/_type"] == "table-file" and row["samples/nrows"] == 3
    assert rows[1]["batch/skipped_batches"] == 1.0
    config = wandb_records.config(run_dir)
    assert config["run"] == RUN
    assert config["inference_api_key"] == "**********"
    assert config["tracking"]["tracker"] == ["tensorboard", "wandb"]
    table = json.loads((run_dir / "files" / rows[2]["samples/path"]).read_text())
    assert table["columns"] == list(COLUMNS)
    assert [r[1] for r in table["data"]] == ["c", "d", "c"]
    sync = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(runs)},
    )
    assert f"Would sync 1 run(s):\nwandb:   {run_dir}/run-" in sync.stderr + sync.stdout, sync
    conversation = table["data"][0][COLUMNS.index("conversation")]
    assert conversation.startswith("[turn 1 · weights v0 · reward 1") and "⟦" in conversation


@pytest.mark.slow
def test_a_replay_is_tracked_the_same_way(
    published: tuple[str, Path], tiny_model_dir: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    url, work = published
    runs, steps, _ = run_learner(
        work,
        tiny_model_dir,
        url,
        "--replay",
        "stream:..",
        "--tracker",
        "tensorboard",
        "--tracker-run-name",
        "replayed",
        "--tracker-sample-interval",
        "2",
    )
    assert [s["step"] for s in steps] == [1, 2]  # a,b / z1,z2 skipped / c,d
    events = EventAccumulator(str(runs / "tensorboard" / "replayed"), size_guidance={"tensors": 0})
    events.Reload()
    for record in steps:
        for name, value in expected_scalars(record).items():
            logged = {e.step: e.value for e in events.Scalars(name)}
            assert logged[record["step"]] == np.float32(value), name
    assert [(e.step, e.value) for e in events.Scalars("batch/skipped_batches")] == [(1, 1.0)]
    assert [e.step for e in events.Tensors("samples/text_summary")] == [2]
