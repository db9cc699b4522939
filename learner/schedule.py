"""Learning-rate and KL-coefficient schedules as pure functions of the learner's step.

The learning rate of step `step` (0-based, the update about to be taken) is derived from the
step alone, so a resumed learner continues the schedule exactly without storing a scheduler:
a linear warm-up over ``lr_warmup_steps`` from ``lr / warmup`` to ``lr``, then constant, or
linear or cosine decay to ``min_lr_ratio x lr`` at ``decay_steps`` (and flat after).

The adaptive KL controller (Ziegler et al. 2019, as verl's ``AdaptiveKLController``) moves the
coefficient toward a target KL: ``coef x (1 + clip(kl / target - 1, -0.2, 0.2) x n / horizon)``
after a step of ``n`` sequences; the learner keeps the coefficient in its checkpointed state.
"""

from __future__ import annotations

import math

from learner.config import LrSchedule, OptimConfig


def learning_rate(cfg: OptimConfig, step: int, decay_steps: int) -> float:
    """The learning rate of update number `step` (0-based)."""
    base = cfg.learning_rate
    if step < cfg.lr_warmup_steps:
        return base * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_schedule is LrSchedule.CONSTANT or decay_steps <= cfg.lr_warmup_steps:
        return base
    progress = min((step - cfg.lr_warmup_steps) / (decay_steps - cfg.lr_warmup_steps), 1.0)
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule is LrSchedule.LINEAR:
        return base * (1.0 - (1.0 - floor) * progress)
    return base * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def adaptive_kl(coef: float, kl: float, target: float, sequences: int, horizon: int) -> float:
    """The KL coefficient after a step of `sequences` whose mean per-token KL was `kl`."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * sequences / horizon)
