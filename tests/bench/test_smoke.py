"""Every benchmark runs in its `--smoke` mode and prints its table and one JSON envelope.

A benchmark rots when the code under it changes (`bench learner` once crashed on a changed
`WeightPusher.push`); these runs make that a CI failure. They assert only that the run
completes, that stdout is the envelope of `bench._report` with the machine's load, and
that the table (stderr under `--json`) was printed; the figures themselves are not checked,
but for the soak's trimming (a learner whose trimming had died soaked a whole hour).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import available
from tests.conftest import require
from tests.sandbox.conftest import bwrap_available, docker_available

ROOT = Path(__file__).resolve().parents[2]

# benchmark -> (extra arguments, a line of its table, what it needs)
SMOKES = {
    "broker": ([], "raw XADD = redis-benchmark", ()),
    "datasets": ([], "RSS on 16 MB minus on 1 MB", ()),
    "e2e": ([], "wall time to target s", ()),
    "envs": ([], "codegym tool call", ("bwrap",)),
    "farm": ([], "tool calls/s (code attempts)", ("bwrap",)),
    "inference": ([], "reload_weights (s)", ()),
    "learner": ([], "share of step time waiting", ()),
    "learner --memory": (["--memory"], "| chunked | 256 |", ()),
    "lora": ([], "push per version (s)", ()),
    "sandbox": ([], "speed-up vs docker exec", ("docker",)),
    "soak": ([], "nothing lost:", ()),
    "tooltask": ([], "| spec | episodes | tool call |", ()),
    "workers": ([], "sync batch-barrier loop", ()),
}
MARKS = {"bwrap": pytest.mark.bwrap, "docker": pytest.mark.docker}


def test_every_benchmark_has_a_smoke() -> None:
    assert {key.split()[0] for key in SMOKES} == set(available())


@pytest.mark.slow
@pytest.mark.parametrize(
    "key",
    [pytest.param(k, marks=[MARKS[n] for n in needs]) for k, (_, _, needs) in SMOKES.items()],
)
def test_smoke(key: str) -> None:
    extra, table_line, needs = SMOKES[key]
    if "bwrap" in needs:
        require(bwrap_available(), "bubblewrap (bwrap)")
    if "docker" in needs:
        require(docker_available(), "a Docker engine")
    name = key.split()[0]
    argv = [sys.executable, "-m", "bench", name, *extra, "--smoke", "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    envelope = json.loads(done.stdout)
    assert envelope["bench"] == name
    assert envelope["argv"] == [*extra, "--smoke", "--json"]
    machine = envelope["machine"]
    for when in ("load_before", "load_after"):
        assert len(machine[when]) == 3 and all(x >= 0 for x in machine[when])
    assert machine["quiet"] is False  # subprocess.run closes an inherited lock descriptor
    assert envelope["result"]
    if name == "soak":  # the learner trimmed what it had acked, and nothing was lost
        redis = envelope["result"]["redis"]  # most of what was published is gone at the end
        assert redis["held_entries"] < redis["trimmed_entries"], done.stderr[-3000:]
        assert envelope["result"]["goals"]["nothing_lost"], done.stderr[-3000:]
        # Redis's time series is kept, and its seen sets are ids at ~120 bytes each: the
        # attribution a long soak reads its growth from.
        assert len(redis["series"]) == envelope["result"]["samples"]
        assert redis["series"][-1]["seen_ids"] > 0
        assert 60 <= redis["seen_bytes_per_id"][0] <= redis["seen_bytes_per_id"][1] <= 400
    assert table_line in done.stderr
    assert "(machine: " in done.stderr


def test_quiet_is_detected_from_the_inherited_lock(tmp_path: Path) -> None:
    """`quiet` execs the command with its flock'ed lock file open: that is the signal."""
    lock = tmp_path / "quiet.lock"
    probe = [sys.executable, "-c", "from bench._report import under_quiet; print(under_quiet())"]
    env = {**os.environ, "QUIET_LOCK": str(lock)}
    with lock.open("w") as held:
        inherited = subprocess.run(
            probe, cwd=ROOT, env=env, pass_fds=(held.fileno(),), capture_output=True, text=True
        )
        closed = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True)
    assert inherited.stdout.strip() == "True", inherited.stderr
    assert closed.stdout.strip() == "False", closed.stderr


@pytest.mark.slow
def test_inference_on_a_model_directory_smoke(tiny_model_dir: Path) -> None:
    """`bench inference --model DIR --multi-turn` (the SmolLM2 rows) at smoke sizes."""
    extra = ["--model", str(tiny_model_dir), "--multi-turn", "--threads", "1"]
    argv = [sys.executable, "-m", "bench", "inference", *extra, "--smoke", "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)["result"]
    assert result["ceiling_ratio"] > 0 and result["batching_ratio"] > 0
    assert result["mt_hit_rate"] > 0  # the cache-on side reused the shared prompt
    assert "(ceiling)" in done.stderr and "multi-turn tokens/s" in done.stderr


@pytest.mark.slow
def test_step_profile_smoke() -> None:
    """`python -m bench._step_profile` (the worker step's profile) at the smallest size."""
    argv = [sys.executable, "-m", "bench._step_profile", "--rounds", "1", "--episodes", "20"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["loop_pieces_us"] and result["client_pieces_alone_us"]
    assert all(v > 0 for v in result["client_pieces_alone_us"].values())
