"""Run by test_tracking.py in a process of its own: a real wandb crash mid-run.

Opens the tracker with both backends (W&B offline), logs step 1, SIGKILLs this process's
own wandb-core child (found by parent pid, killed by pid), logs steps 2 and 3, closes,
and prints the steps TensorBoard holds and the backends still running, as JSON.
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
    cfg = TrackingConfig(tracker=["tensorboard", "wandb"], tracker_dir=out,
                         tracker_sample_interval=0, tracker_wandb_mode="offline")  # fmt: skip
    tracker = open_tracker(cfg, "crash", {"run": "crash"}, model)
    groups = [make_group("g", [0.0, 1.0])]
    prepared = prepare_batch(groups, BatchRules(), 0)
    for step in (1, 2, 3):
        record = StepRecord.measure(step, step, 1, prepared, None, 0.5, 0.0)
        tracker.step(record, groups, prepared)
        if step == 1:
            kill_wandb_core()
    running = [b.name for b in tracker.backends]
    tracker.close()
    print(json.dumps({"running": running}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
