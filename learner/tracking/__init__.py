"""Experiment trackers for the learner: W&B and TensorBoard, both optional.

`open_tracker(cfg)` returns one `Tracker` fanning out to the backends named by
``--tracker``; with none named it does nothing and imports nothing. Each step's record,
the resolved config (secrets masked) and, every ``--tracker-sample-interval`` steps, a
table of sample trajectories (rendered by `learner.tracking.render`) go to every backend.
A backend that fails (a crashed wandb service, a full disk) is logged once and dropped;
training goes on. wandb and tensorboard are imported only when asked for (the
``tracking`` extra installs them). See docs/tracking.md.
"""

from __future__ import annotations

from learner.tracking.base import Backend, Tracker, open_tracker

__all__ = ["Backend", "Tracker", "open_tracker"]
