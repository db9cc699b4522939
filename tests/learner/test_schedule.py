"""Learning-rate schedule and adaptive KL controller against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from learner.config import LearnerConfig, LrSchedule
from learner.schedule import adaptive_kl, learning_rate


def _optim(**flags: object) -> LearnerConfig:
    return LearnerConfig.load({"model": "m", "learning_rate": 1e-3, **flags}, environ={})


def test_warm_up_then_constant() -> None:
    cfg = _optim(lr_warmup_steps=4)
    got = [learning_rate(cfg.optim, step, cfg.lr_decay_steps) for step in range(6)]
    assert got == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize(
    ("schedule", "middle"),
    [(LrSchedule.LINEAR, 1e-3 * (1 - 0.9 * 0.5)), (LrSchedule.COSINE, 1e-3 * (0.1 + 0.9 * 0.5))],
)
def test_decay_from_the_end_of_warm_up_to_the_floor(schedule: LrSchedule, middle: float) -> None:
    # warm-up 2, decay over steps 2..12 to 0.1 x lr; half-way (step 7) and after the end
    cfg = _optim(lr_warmup_steps=2, lr_schedule=schedule.value, max_steps=12, min_lr_ratio=0.1)
    lr = [learning_rate(cfg.optim, step, cfg.lr_decay_steps) for step in range(15)]
    assert lr[2] == pytest.approx(1e-3) and lr[7] == pytest.approx(middle)
    assert lr[12] == pytest.approx(1e-4) and lr[14] == pytest.approx(1e-4)
    assert all(a >= b for a, b in itertools.pairwise(lr[2:]))
    # --lr-decay-steps overrides --max-steps as the end of the decay
    cfg = _optim(lr_schedule=schedule.value, max_steps=100, lr_decay_steps=10, min_lr_ratio=0.0)
    assert learning_rate(cfg.optim, 10, cfg.lr_decay_steps) == pytest.approx(0.0, abs=1e-12)


def test_adaptive_kl_moves_toward_the_target_within_20_percent() -> None:
    # error clipped to +-0.2, scaled by the step's share of the horizon: 64 / 1000
    assert adaptive_kl(0.1, 0.02, 0.01, 64, 1000) == pytest.approx(0.1 * (1 + 0.2 * 0.064))
    assert adaptive_kl(0.1, 0.011, 0.01, 64, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.064))
    assert adaptive_kl(0.1, 0.0, 0.01, 64, 1000) == pytest.approx(0.1 * (1 - 0.2 * 0.064))
    assert adaptive_kl(0.1, 0.01, 0.01, 64, 1000) == pytest.approx(0.1)
    assert math.isclose(adaptive_kl(0.1, 5.0, 0.01, 1000, 1000), 0.12)
