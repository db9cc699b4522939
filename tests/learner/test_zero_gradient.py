"""A batch with no gradient takes no optimizer step (issue 46).

AdamW moves the weights on a zero gradient (its momentum, its weight decay) and decays its
second moment, so that the next real gradient moves them further. Here a hundred
all-zero-advantage batches follow a real one: no parameter may move, and the next real step
must be exactly the step it would have been without them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from learner.algorithms import Algorithm
from learner.batch import BatchRules, Sample, prepare_batch
from learner.config import Aggregation, LearnerConfig, LossConfig, OptimConfig
from learner.core import build_core, skip_record
from learner.distributed import DistContext
from learner.trainer import Trainer
from tests.learner.factories import make_group

# --no-skip-zero-variance: all-equal groups are trained, with zero advantages
RULES = BatchRules(Algorithm.GRPO, 1.0, max_staleness=4, skip_zero_variance=False)
ZERO_BATCHES = 100  # Adam's momentum moves the weights at the first; each costs ~0.1 s of CPU


def _trainer(model_dir: Path, loss: LossConfig | None = None) -> Trainer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = OptimConfig(
        learning_rate=3e-3,
        weight_decay=0.01,  # decay, too, would move the weights on a zero gradient
        max_grad_norm=1.0,
        micro_batch_size=8,
        aggregation=Aggregation.TOKEN_MEAN,
    )
    return Trainer(model, optim, torch.device("cpu"), DistContext(), loss=loss)


def _samples(group_id: str, rewards: list[float]) -> list[Sample]:
    return prepare_batch([make_group(group_id, rewards)], RULES, 0).samples


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.parameters()]


def _largest_move(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))


def test_zero_advantage_batches_move_nothing_and_leave_the_next_step_unchanged(
    tiny_model_dir: Path,
) -> None:
    first, second = (
        _samples("real-1", [0.0, 1.0, 0.0, 1.0]),
        _samples("real-2", [1.0, 0.0, 0.0, 0.0]),
    )
    zero = _samples("solved", [1.0, 1.0, 1.0, 1.0])
    assert zero and all(not s.advantages.any() for s in zero)

    skipped = _trainer(tiny_model_dir)
    assert skipped.update(first).optimizer_steps == 1
    after_first = _weights(skipped)
    zero_stats = [skipped.update(zero) for _ in range(ZERO_BATCHES)]
    assert _largest_move(after_first, _weights(skipped)) == 0.0  # nothing moved
    assert all(s.grad_norm == 0.0 for s in zero_stats)
    assert {(s.optimizer_steps, s.zero_gradient_steps) for s in zero_stats} == {(0, 1)}
    skipped.update(second)
    moved_after_zeros = _largest_move(after_first, _weights(skipped))

    plain = _trainer(tiny_model_dir)  # the same two real batches, nothing between them
    plain.update(first)
    before = _weights(plain)
    plain.update(second)
    moved_plain = _largest_move(before, _weights(plain))
    assert moved_plain > 0.0
    assert moved_after_zeros <= moved_plain
    assert all(torch.equal(a, b) for a, b in zip(_weights(skipped), _weights(plain), strict=True))


def test_only_the_zero_gradient_mini_batch_is_skipped(tiny_model_dir: Path) -> None:
    """Two mini-batches, one all zero-advantage: one optimizer step taken, one skipped;
    micro-batches accumulating into one step with any gradient are a step."""
    loss = LossConfig(mini_batches=2)
    trainer = _trainer(tiny_model_dir, loss)
    zero, real = _samples("z", [1.0] * 4), _samples("r", [0.0, 1.0, 0.0, 1.0])
    stats = trainer.update([*zero, *real])
    assert (stats.optimizer_steps, stats.zero_gradient_steps) == (1, 1)
    one_mini = _trainer(tiny_model_dir)  # same batch in one mini-batch: accumulated, a step
    assert one_mini.update([*zero, *real]).optimizer_steps == 1


def test_an_entropy_bonus_is_a_gradient(tiny_model_dir: Path) -> None:
    """Zero advantages with an entropy bonus still carry a gradient: the step is taken."""
    trainer = _trainer(tiny_model_dir, LossConfig(entropy_coef=0.01))
    before = _weights(trainer)
    stats = trainer.update(_samples("z", [1.0] * 4))
    assert (stats.optimizer_steps, stats.zero_gradient_steps) == (1, 0)
    assert _largest_move(before, _weights(trainer)) > 0.0


def test_a_zero_gradient_batch_is_not_a_step(tiny_model_dir: Path) -> None:
    """Through the learner's core: no step, no version, the schedule stays, and the batch is
    logged as skipped for its zero gradient (counted)."""
    core = build_core(
        LearnerConfig.load(
            {"model": tiny_model_dir, "skip_zero_variance": False, "lr_warmup_steps": 4},
            environ={},
        ),
        DistContext(),
        torch.device("cpu"),
    )
    core.train([make_group("r0")], replay=False)
    assert core.state.step == 1
    lr = core.trainer.optimizer.param_groups[0]["lr"]
    before = _weights(core.trainer)
    for k in range(5):
        prepared, stats = core.train([make_group(f"z{k}", [1.0] * 4)], replay=False)
        assert stats is None and prepared.samples
    assert core.state.step == 1
    assert core.state.counters["zero_gradient_steps"] == 5
    assert core.state.counters["skipped_batches"] == 5
    assert _largest_move(before, _weights(core.trainer)) == 0.0
    record = skip_record(core, [make_group("z4", [1.0] * 4)], prepared, 0.0)
    assert record.reason == "zero_gradient" and record.step == 1
    core.train([make_group("r1")], replay=False)
    assert core.state.step == 2  # the next real batch is step 2, at the schedule's step 2
    assert core.trainer.optimizer.param_groups[0]["lr"] > lr
    assert dataclasses.asdict(record)["reason"] == "zero_gradient"
