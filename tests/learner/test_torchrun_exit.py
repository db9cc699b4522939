"""A two-rank learner under torchrun exits 0 after `done`, with the CPU busy.

Under FSDP2 the gloo process group outlived `destroy_process_group` (DTensor's caches hold the
device mesh, the mesh holds the group), so its threads ran on until interpreter teardown
destroyed the group while the other rank was exiting too; with the CPU busy a rank died in
that window, after `done`, with "terminate called without an active exception" (SIGABRT),
and torchrun reported the job failed. `learner.distributed.DistContext.close` now ends the
group. This test runs the two-rank replay job twice beside busy loops (one more than there
are cores): each time both ranks exit 0, nothing aborts, and no process-group thread is left
when a rank's interpreter starts its exit (`tests.learner.exit_probe`). The abort itself is a
race; the threads left at exit are what it needs, and they are there on every run of the old
code, so two runs hold the regression (five took 98 s of the suite's budget).

It is an `alone` module (tests/conftest.py): it saturates every core on purpose, which would
slow and skew whatever ran beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import RedisServer, require
from tests.learner.test_replay import KEYS, seed_stream_and_archive

RUNS = 2
PROBE = re.compile(r"exit-probe rank (\d+) threads (\[[^\]]*\])")
# the gloo process group's threads: its event loop and its work threads
GROUP_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


@contextmanager
def busy_loops(count: int) -> Iterator[None]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(10)


def two_rank_replay(model: Path, redis_url: str, out: Path) -> subprocess.CompletedProcess[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    require(torchrun is not None, "torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.learner.exit_probe",
        "--model",
        str(model),
        "--redis-url",
        redis_url,
        "--replay",
        "stream:..",
        "--checkpoint-dir",
        str(out),
        "--groups-per-batch",
        "4",
        "--micro-batch-size",
        "3",
    ]
    env = {**os.environ, "FARM_RUN": KEYS.run}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_two_ranks_exit_cleanly_after_done_with_the_cpu_busy(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    asyncio.run(seed_stream_and_archive(redis_server.url, tmp_path / "archive"))
    with busy_loops((os.cpu_count() or 1) + 1):
        for run in range(RUNS):
            job = two_rank_replay(tiny_model_dir, redis_server.url, tmp_path / f"out{run}")
            tail = job.stderr[-3000:]
            assert '"event": "done"' in job.stderr, f"run {run}: {tail}"
            assert "terminate called" not in job.stderr, f"run {run}: {tail}"
            assert job.returncode == 0, f"run {run}: exit {job.returncode}: {tail}"
            threads = {int(m[1]): json.loads(m[2]) for m in PROBE.finditer(job.stderr)}
            assert set(threads) == {0, 1}, f"run {run}: {tail}"
            for rank, names in threads.items():
                left = [n for n in names if n in GROUP_THREADS]
                assert not left, f"run {run}: rank {rank} exits with the group's threads {left}"
