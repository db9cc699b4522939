"""Evaluation through the real farm: redis-server, the CPU policy server with the tiny model,
a `python -m workers` process and the learner with ``--eval-tasks``.

* eval lines in the step log (before training, every interval, and the round in flight at
  the end), eval-STEP.json in the run directory, and the scalars read back from TensorBoard;
* every eval group sits on the eval stream and none on the trajectories stream, so none is
  trained; each eval task id comes back once;
* a bad eval spec stops the learner before torch is imported, with exit status 2.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker import status
from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.keys import ARCHIVER_GROUP, RunKeys
from broker.messages import TrajectoryGroup
from tests.conftest import RedisServer
from tests.learner.farm import ROOT, farm, toy_tasks

RUN = "evals"


def eval_lines(log: str) -> list[dict]:
    return [
        json.loads(line.split(" learner ", 1)[1])
        for line in log.splitlines()
        if '"event": "eval"' in line
    ]


async def stream_groups(url: str, stream: str) -> list[TrajectoryGroup]:
    redis = await connect(RedisSettings.from_url(url))
    try:
        rows = await redis.xrange(stream)
    finally:
        await redis.aclose()
    return [decode(fields, expect=TrajectoryGroup) for _, fields in rows]  # type: ignore[misc]


async def keep_for_an_archiver(url: str, keys: RunKeys) -> None:
    """An archiver's group that reads nothing, on the eval and trajectory streams: the
    learner's stream keeper trims only what every group has acknowledged, so the streams
    keep all the run wrote for the checks below."""
    redis = await connect(RedisSettings.from_url(url))
    try:
        for stream in (keys.evals(), keys.trajectories()):
            await redis.xgroup_create(stream, ARCHIVER_GROUP, id="0", mkstream=True)
    finally:
        await redis.aclose()


async def read_state(url: str, keys: RunKeys) -> status.RunState:
    redis = await connect(RedisSettings.from_url(url))
    try:
        return await status.run_state(redis, keys)
    finally:
        await redis.aclose()


@pytest.mark.slow
def test_eval_runs_through_the_farm_and_is_never_trained(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(json.dumps({"env_spec": f'toy@{{"difficulty": {d}}}'}) + "\n" for d in (0, 0, 1))
    )
    asyncio.run(keep_for_an_archiver(redis_server.url, RunKeys(RUN)))
    with farm(tmp_path) as f:
        url = f.server("server", tiny_model_dir)
        worker = f.worker("w0", redis_server.url, RUN, url, tiny_model_dir, concurrency=64)
        learner = f.spawn(
            "learner",
            [
                "learner",
                "--run",
                RUN,
                "--redis-url",
                redis_server.url,
                "--inference-urls",
                url,
                "--model",
                str(tiny_model_dir),
                "--tasks",
                str(toy_tasks(tmp_path / "tasks.jsonl")),
                "--group-size",
                "4",
                "--groups-per-batch",
                "2",
                "--max-steps",
                "4",
                "--weights-dir",
                str(tmp_path / "weights"),
                "--checkpoint-dir",
                str(tmp_path / "ck"),
                "--eval-tasks",
                f"held={held}",
                "--eval-before-train",
                "--eval-interval",
                "2",
                "--eval-samples",
                "3",
                "--eval-temperature",
                "1.0",
                "--eval-max-tokens",
                "1",
                "--tracker",
                "tensorboard",
                "--tracker-dir",
                str(tmp_path / "runs"),
            ],
        )
        assert learner.wait(300) == 0, f.log("learner")[-3000:]
        log = f.log("learner")
        # the worker ran every episode without torch (workers.tokens.load_tokenizer)
        maps = Path(f"/proc/{worker.pid}/maps").read_text()
        assert worker.poll() is None and "libtorch" not in maps, f.log("w0")[-3000:]
        # one evaluation without training, through the same workers, printed as a table
        once = subprocess.run(
            [
                sys.executable,
                "-m",
                "learner",
                "evaluate",
                "--run",
                RUN,
                "--redis-url",
                redis_server.url,
                "--eval-tasks",
                f"held={held}",
                "--eval-samples",
                "2",
                "--eval-timeout-s",
                "120",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=180,
        )
        assert once.returncode == 0, once.stderr[-3000:]
        header, *rows = once.stdout.splitlines()
        assert header.split()[:2] == ["set", "rows"] and "pass_at_2" in header
        assert [r.split()[0] for r in rows[:2]] == ["held", "held/toy"]
        assert rows[2].startswith("tasks 3, missing 0"), once.stdout
    lines = eval_lines(log)
    assert [e["step"] for e in lines] == [0, 2, 4], log[-3000:]
    for e in lines:
        assert e["tasks"] == 3 and e["missing_rows"] == 0
        figures = e["sets"]["held"]
        assert figures["scored_rows"] == 3 and 0.0 <= figures["pass_at_1"] <= 1.0
        assert figures["pass_at_3"] >= figures["pass_at_1"]
        assert e["sets"]["held/toy"] == figures
        assert e["weight_versions"][0] >= 0
    assert json.loads((tmp_path / "ck" / "eval-000002.json").read_text()) == lines[1]

    keys = RunKeys(RUN)
    state = asyncio.run(read_state(redis_server.url, keys))
    assert state.last_eval == lines[-1]  # the newest of the learner's evaluations
    assert "\n  last eval held at step 4: mean@3 " in status.format_state(state)
    evals = asyncio.run(stream_groups(redis_server.url, keys.evals()))
    trained = asyncio.run(stream_groups(redis_server.url, keys.trajectories()))
    assert all(g.task.is_eval for g in evals) and len(evals) == 12  # 3 rounds + evaluate
    assert len({g.group_id for g in evals}) == 12
    assert not any(g.task.is_eval for g in trained) and trained
    assert sorted(len(g.trajectories) for g in evals) == [2] * 3 + [3] * 9

    acc = EventAccumulator(
        str(tmp_path / "runs" / "tensorboard" / RUN), size_guidance={"tensors": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    found = tags.get("scalars", []) + tags.get("tensors", [])
    assert "eval/held/pass_at_1" in found, found
    steps = [
        e.step
        for e in (
            acc.Scalars("eval/held/pass_at_1")
            if "eval/held/pass_at_1" in tags.get("scalars", [])
            else acc.Tensors("eval/held/pass_at_1")
        )
    ]
    assert steps == [0, 2, 4]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("held={file}", "eval set 'held'"),
        ("={file}", "NAME=FILE"),
        ("held", "NAME=FILE"),
        ("held={missing}", "cannot read"),
    ],
)
def test_a_bad_eval_spec_fails_fast(tmp_path: Path, spec: str, reason: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"env_spec": "no-such-env@{}"}) + "\n")
    arg = spec.format(file=bad, missing=tmp_path / "missing.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "learner", "--model", str(tmp_path), "--eval-tasks", arg],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert reason in done.stderr, done.stderr[-2000:]
    assert "training on" not in done.stderr  # stopped before the model was built
