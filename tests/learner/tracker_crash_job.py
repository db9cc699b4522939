"""Run by test_tracking.py in a process of its own: a real wandb crash mid-run.

Opens the tracker with both backends (W&B offline), logs step 1, SIGKILLs this process's
own wandb-core child (found by parent pid, killed by pid), logs steps until wandb fails
(its client sees the lost socket a moment later) and two more, closes, and prints the
backends still running, the step wandb failed at and the last step, as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from learner.batch import prepare_batch
from learner.config import BatchRules
from learner.record import StepRecord
from learner.tracking.base import open_tracker
from learner.tracking.config import TrackingConfig
from tests.learner.factories import make_group


def children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def kill_wandb_core() -> None:
    """SIGKILL the wandb service this process started; return once it is dead (a zombie:
    wandb's own handle reaps it)."""
    cores = [p for p in children() if Path(f"/proc/{p}/comm").read_text().strip() == "wandb-core"]
    assert len(cores) == 1, cores
    os.kill(cores[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{cores[0]}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline, "wandb-core did not die"
        time.sleep(0.01)


def main(out: Path, model: Path) -> None:
    cfg = TrackingConfig(
        tracker=["tensorboard", "wandb"],
        tracker_dir=out,
        tracker_sample_interval=0,
        tracker_wandb_mode="offline",
    )
    tracker = open_tracker(cfg, "crash", {"run": "crash"}, model)
    groups = [make_group("g", [0.0, 1.0])]
    prepared = prepare_batch(groups, BatchRules(), 0)

    def step(n: int) -> None:
        tracker.step(
            StepRecord.measure(n, n, 1, prepared, None, wait_s=0.5, push_s=0.0), groups, prepared
        )

    step(1)
    kill_wandb_core()
    n, deadline = 1, time.monotonic() + 30
    while "wandb" in [b.name for b in tracker.backends]:  # wandb notices the lost socket
        assert time.monotonic() < deadline, "wandb never failed after its service died"
        n += 1
        step(n)
        time.sleep(0.05)
    dropped_at, last = n, n + 2
    for after in range(dropped_at + 1, last + 1):  # training (and the other tracker) goes on
        step(after)
    running = [b.name for b in tracker.backends]
    tracker.close()
    print(json.dumps({"running": running, "dropped_at": dropped_at, "last": last}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
