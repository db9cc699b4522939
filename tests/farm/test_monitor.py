"""What Prometheus reads of a farm: targets.json follows the children, `--monitor` and
`--archive` add their processes, `--stream-maxlen` reaches the learner.

The targets file is driven by the real supervisor with small Python children (one crashes
once and is restarted); `farm up --monitor --archive` against a running stack, in a browser,
is tests/farm/test_up.py.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path

import pytest

from farm.config import load_config
from farm.errors import StartupError
from farm.monitor import TargetsFile
from farm.stack import build_stack, dry_run
from farm.supervisor import ProcessSpec, RestartPolicy, Supervisor
from tests.farm.test_supervisor import Lines

SLOW_RESTART = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=1.0, max_restarts=3, window_s=30)


def _targets(path: Path) -> dict[str, tuple[str, str]]:
    """child (the supervisor: "") -> (job, address), as Prometheus's file_sd reads the file."""
    return {
        g["labels"].get("child", ""): (g["labels"]["job"], g["targets"][0])
        for g in json.loads(path.read_text())
    }


async def test_targets_file_lists_the_running_children_through_a_restart(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    crash_once = (
        "import pathlib, sys, time\n"
        f"m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists():\n    m.touch(); sys.exit(1)\n"
        "time.sleep(60)\n"
    )
    sleep = (sys.executable, "-c", "import time; time.sleep(60)")
    specs = [
        ProcessSpec("learner", sleep, metrics_url="http://127.0.0.1:9102/metrics"),
        ProcessSpec("worker-0", (*sleep[:2], crash_once), metrics_url="http://127.0.0.1:9101/m"),
        ProcessSpec("archiver-0", sleep),
    ]
    path = tmp_path / "targets.json"
    targets = TargetsFile(path, {s.name: s.metrics_url for s in specs if s.metrics_url}, 9400)
    lines = Lines()
    supervisor = Supervisor(specs, lines, SLOW_RESTART, targets.child)
    targets.start()
    assert _targets(path) == {"": ("farm-supervisor", "127.0.0.1:9400")}
    seen: dict[str, dict[str, tuple[str, str]]] = {}

    def said(start: str) -> int:
        return sum(t.startswith(start) for t in lines.of("farm"))

    async def watch(stop: asyncio.Event) -> None:
        await lines.until(lambda: said("worker-0 exited with status 1") == 1)
        seen["down"] = _targets(path)  # within the 1 s backoff
        await lines.until(lambda: said("worker-0 started") == 2)
        seen["back"] = _targets(path)
        supervisor.request_stop("test done")

    await asyncio.wait_for(supervisor.run(watch), 30)
    targets.close()
    learner = ("farm-learner", "127.0.0.1:9102")
    assert seen["down"] == {"": ("farm-supervisor", "127.0.0.1:9400"), "learner": learner}
    assert seen["back"]["worker-0"] == ("farm-worker", "127.0.0.1:9101")
    assert set(seen["back"]) == {"", "learner", "worker-0"}  # the archiver serves none
    assert json.loads(path.read_text()) == []  # a stopped farm: nothing to scrape
    assert not list(tmp_path.glob("*.tmp"))


def test_monitor_and_archive_add_their_processes_and_retention_reaches_the_learner(
    tmp_path: Path,
) -> None:
    work, archive = tmp_path / "run", tmp_path / "archive"
    cfg = load_config(
        None,
        work_dir=work,
        workers=1,
        monitor=True,
        prometheus_port=19090,
        archive=archive,
        partitions=2,
        stream_maxlen=5000,
        stream_max_bytes=1 << 20,
    )
    lines = dry_run(cfg)
    names = [line[2:] for line in lines[::2]]
    commands = dict(zip(names, (shlex.split(line) for line in lines[1::2]), strict=True))
    # Prometheus first (it scrapes every child from its start), the archivers before the
    # learner (the trimmer waits for their group from the first entry on)
    assert names == [
        "build-model",
        "prometheus",
        "redis",
        "archiver-0",
        "archiver-1",
        "inference",
        "learner",
        "worker-0",
    ]
    assert "--web.listen-address=127.0.0.1:19090" in commands["prometheus"]
    assert commands["archiver-0"][-5:] == [
        "archive",
        "trajectories",
        "--out",
        str(archive),
        "--follow",
    ]
    assert commands["archiver-1"][-4:-1] == [
        "trajectories:1",
        "--out",
        str(archive / "partition-1"),
    ]
    for name in ("archiver-0", "archiver-1"):
        assert commands[name][commands[name].index("--partitions") + 1] == "2"
    learner = " ".join(commands["learner"])
    assert "--stream-maxlen 5000" in learner and f"--stream-max-bytes {1 << 20}" in learner
    assert not work.exists() and not archive.exists()  # a dry run writes nothing


def test_monitor_without_prometheus_says_what_to_install(tmp_path: Path) -> None:
    cfg = load_config(None, work_dir=tmp_path, monitor=True, prometheus_bin="no-such-prometheus")
    with pytest.raises(StartupError, match="Debian package prometheus"):
        build_stack(cfg, tmp_path / "model", tmp_path / "tasks.jsonl", dry_run=True)
