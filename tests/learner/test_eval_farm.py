"""`learner filter` and `learner evaluate` through real workers, on an environment whose pass
rate is known per task (`tests.learner.evalenvs`): redis-server, the CPU policy server with
the tiny model and `python -m workers` processes.

* the filter keeps exactly the tasks whose pass rate lies in the band, each with its rate;
* an evaluation whose worker is SIGKILLed mid-round still completes: the dead worker's tasks
  are reclaimed and redone elsewhere, and each task is counted once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from broker.codec import decode
from broker.connection import RedisSettings, connect
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import TrajectoryGroup
from tests.conftest import RedisServer
from tests.learner.farm import ROOT, Farm, farm
from workers.tokens import load_codec

ENVS = "tests.learner.evalenvs"
# (passes, of): the pass rate of each row with `of` samples
RATES = [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]


def worker(f: Farm, name: str, redis_url: str, run: str, url: str, *, model: Path) -> int:
    proc = f.spawn(
        name,
        [
            "workers",
            "--redis-url",
            redis_url,
            "--run",
            run,
            "--inference-urls",
            url,
            "--model",
            str(model),
            "--max-tokens",
            "1",
            "--concurrency",
            "8",
            "--worker-id",
            name,
            "--env-modules",
            ENVS,
            "--reclaim-idle-s",
            "2",
        ],
    )
    return proc.pid


def learner(command: str, redis_url: str, run: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "learner",
            command,
            "--redis-url",
            redis_url,
            "--run",
            run,
            "--env-modules",
            ENVS,
            *args,
        ],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def rows(path: Path, step_s: float = 0.0) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {"env_spec": "ev-rate@" + json.dumps({"passes": p, "of": n, "step_s": step_s})}
            )
            + "\n"
            for p, n in RATES
        )
    )
    return path


@pytest.fixture
def eval_farm(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[Farm, str]]:
    with farm(tmp_path) as f:
        url = f.server("server", tiny_model_dir)
        yield f, url


@pytest.mark.slow
# one band through the farm; its edges (inclusive, zero-width) are tests/learner/test_filter_band.py
@pytest.mark.parametrize(("keep", "kept"), [("0.1:0.9", [1, 2, 3])])
def test_filter_keeps_the_band(
    eval_farm: tuple[Farm, str],
    redis_server: RedisServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    *,
    keep: str,
    kept: list[int],
) -> None:
    f, url = eval_farm
    worker(f, "w0", redis_server.url, "filt", url, model=tiny_model_dir)
    out = tmp_path / "kept.jsonl"
    proc = learner(
        "filter",
        redis_server.url,
        "filt",
        "--tasks",
        str(rows(tmp_path / "in.jsonl")),
        "--out",
        str(out),
        "--samples",
        "4",
        "--keep",
        keep,
    )
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    want = [RATES[i] for i in kept]
    assert [json.loads(r["env_spec"].split("@", 1)[1])["passes"] for r in lines] == [
        p for p, _ in want
    ]
    assert [r["meta"]["pass_rate"] for r in lines] == [p / n for p, n in want]
    assert f"kept {len(kept)} of 5" in stdout


def test_filter_refuses_a_bad_band(tmp_path: Path) -> None:
    proc = learner(
        "filter",
        "redis://127.0.0.1:1/0",
        "filt",
        "--tasks",
        str(rows(tmp_path / "in.jsonl")),
        "--out",
        str(tmp_path / "o"),
        "--keep",
        "0.9:0.1",
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "LO <= HI" in stderr, stderr[-2000:]


async def _pending_on(url: str, keys: RunKeys, consumer: str) -> int:
    redis = await connect(RedisSettings.from_url(url))
    try:
        info = await redis.xpending_range(keys.tasks, WORKERS_GROUP, "-", "+", 100, consumer)
        return len(info)
    except ResponseError:  # NOGROUP: the worker has not created its group yet
        return 0
    finally:
        await redis.aclose()


async def _eval_groups(url: str, keys: RunKeys) -> list[TrajectoryGroup]:
    redis = await connect(RedisSettings.from_url(url))
    try:
        return [decode(fl, expect=TrajectoryGroup) for _, fl in await redis.xrange(keys.evals())]  # type: ignore[misc]
    finally:
        await redis.aclose()


@pytest.mark.slow
def test_eval_survives_a_worker_sigkill_and_counts_each_task_once(
    eval_farm: tuple[Farm, str], redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    f, url = eval_farm
    keys = RunKeys("kill")
    victim = worker(f, "w-victim", redis_server.url, "kill", url, model=tiny_model_dir)
    time.sleep(3)  # the victim reads first: it takes tasks of the round
    proc = learner(
        "evaluate",
        redis_server.url,
        "kill",
        "--eval-tasks",
        f"rate={rows(tmp_path / 'held.jsonl', step_s=3.0)}",
        "--eval-samples",
        "4",
        "--eval-timeout-s",
        "180",
    )
    deadline = time.monotonic() + 60
    while asyncio.run(_pending_on(redis_server.url, keys, "w-victim")) == 0:
        assert time.monotonic() < deadline and proc.poll() is None, "the victim took no task"
        time.sleep(0.2)
    os.kill(victim, signal.SIGKILL)
    worker(f, "w-survivor", redis_server.url, "kill", url, model=tiny_model_dir)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:] + stdout
    assert "tasks 5, missing 0" in stdout
    rate_line = next(line for line in stdout.splitlines() if line.startswith("rate "))
    assert float(rate_line.split()[5]) == pytest.approx(sum(p for p, _ in RATES) / 20)  # pass@1
    groups = asyncio.run(_eval_groups(redis_server.url, keys))
    assert len(groups) == len({g.group_id for g in groups}) == 5
    assert any(g.worker_id == "w-survivor" for g in groups)


@pytest.mark.slow
def test_eval_over_n_rows_scores_exactly_n_problems_k_times_each(
    eval_farm: tuple[Farm, str], redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two sets, each row its own problem: a Parquet dataset of prompts (the row is the
    problem) and arith's held-out split listed by row (`envs.arith.split_lines`). Before
    rows travelled with eval tasks, the held-out set's row-index seeds drew some sums twice
    and missed others."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from envs.arith import split_lines

    f, url = eval_farm
    worker(f, "w0", redis_server.url, "rows", url, model=tiny_model_dir)
    questions = [f"Spell {n} backwards." for n in range(6)]
    table = pa.Table.from_pylist([{"question": q, "answer": q[::-1]} for q in questions])
    pq.write_table(table, tmp_path / "qa.parquet")
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(split_lines("heldout")) + "\n")
    proc = learner(
        "evaluate",
        redis_server.url,
        "rows",
        *("--eval-tasks", f"qa={tmp_path / 'qa.parquet'}", "--eval-tasks", f"held={held}"),
        *("--prompt-column", "question", "--reward", "exact", "--eval-samples", "3"),
        *("--dataset-cache-dir", str(tmp_path / "cache"), "--eval-timeout-s", "180"),
    )
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:] + stdout
    assert "tasks 26, missing 0" in stdout
    codec = load_codec(str(tiny_model_dir))
    by_set: dict[str, list[str]] = {"qa": [], "held": []}
    for group in asyncio.run(_eval_groups(redis_server.url, RunKeys("rows"))):
        assert group.task.eval is not None and len(group.trajectories) == 3  # k each
        prompts = {codec.decode(t.turns[0].prompt_ids) for t in group.trajectories}
        assert len(prompts) == 1  # the k samples of a row share its problem
        by_set[group.task.eval.set_name].append(prompts.pop())
    assert len(by_set["qa"]) == 6 and all(any(q in p for p in by_set["qa"]) for q in questions)
    assert len(by_set["held"]) == len(set(by_set["held"])) == 20  # every held-out sum, once
