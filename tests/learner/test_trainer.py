"""The training step on the real tiny model: ratio 1 on-policy, gradient direction, and
gradients independent of how the batch is split (sequence counts, token budgets, packing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.messages import Trajectory, TrajectoryGroup, Turn
from learner.algorithms import Algorithm
from learner.batch import BatchRules, Sample, prepare_batch
from learner.config import Aggregation, Correction, LossConfig, OptimConfig, ScaleConfig
from learner.distributed import DistContext
from learner.trainer import Trainer
from tests.learner.factories import make_group

RULES = BatchRules(Algorithm.GRPO, 1.0, max_staleness=4, skip_zero_variance=True)
PLAIN = LossConfig()


def optim(lr: float = 1e-2, micro: int = 8) -> OptimConfig:
    return OptimConfig(
        learning_rate=lr,
        weight_decay=0.0,
        clip_low=0.2,
        clip_high=0.2,
        tis_cap=2.0,
        max_grad_norm=100.0,
        micro_batch_size=micro,
        aggregation=Aggregation.TOKEN_MEAN,
    )


def _trainer(
    model_dir: Path,
    *,
    micro: int = 8,
    lr: float = 1e-2,
    terms: LossConfig = PLAIN,
    reference: object = None,
    scale: ScaleConfig | None = None,
) -> Trainer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return Trainer(
        model,
        optim(lr, micro),
        torch.device("cpu"),
        DistContext(),
        scale=scale or ScaleConfig(),
        loss=terms,
        reference=reference,
    )  # type: ignore[arg-type]


def _with_behaviour(
    group: TrajectoryGroup, samples: list[Sample], logp: torch.Tensor
) -> TrajectoryGroup:
    """Replace each turn's recorded logprobs by the model's own (single-turn groups)."""
    trajectories = []
    for trajectory, row in zip(group.trajectories, logp, strict=True):
        turn = trajectory.turns[0]
        n_p, n_c = len(turn.prompt_ids), len(turn.completion_ids)
        new = Turn(
            turn.prompt_ids,
            turn.completion_ids,
            row[n_p - 1 : n_p - 1 + n_c].numpy(),
            turn.weight_version,
            turn.reward,
            turn.terminated,
            turn.truncated,
        )
        trajectories.append(
            Trajectory((new,), trajectory.finish_reason, sample_index=trajectory.sample_index)
        )
    return TrajectoryGroup(group.group_id, group.task, tuple(trajectories), group.worker_id)


def test_importance_ratio_is_exactly_one_on_policy(tiny_model_dir: Path) -> None:
    trainer = _trainer(tiny_model_dir)
    group = make_group("g-on-policy", [0.0, 1.0, 1.0, 0.0], vocab=256)
    samples = prepare_batch([group], RULES, version=0).samples
    with torch.no_grad():
        _, logp, _, _ = trainer.forward(samples)
    on_policy = prepare_batch([_with_behaviour(group, samples, logp)], RULES, version=0).samples
    stats = trainer.step(on_policy, sum(int(s.loss_mask.sum()) for s in on_policy), len(on_policy))
    assert stats.ratio_mean == 1.0 and stats.ratio_min == 1.0 and stats.ratio_max == 1.0
    assert stats.clip_fraction == 0.0
    # pi_prox/mu, the inference-vs-learner gap, is 1 as well: the behaviour is the model's own
    assert stats.behaviour_ratio_mean == 1.0 and stats.behaviour_ratio_max == 1.0
    assert stats.correction_fraction == 0.0


def _completion_logp(trainer: Trainer, samples: list[Sample]) -> np.ndarray:
    with torch.no_grad():
        batch, logp, _, _ = trainer.forward(samples)
    return (logp * batch["mask"]).sum(dim=1).numpy()


def test_step_raises_rewarded_and_lowers_unrewarded_completions(tiny_model_dir: Path) -> None:
    trainer = _trainer(tiny_model_dir, lr=1e-3)
    group = make_group("g-direction", [1.0, 0.0, 1.0, 0.0], vocab=256)
    samples = prepare_batch([group], RULES, version=0).samples
    with torch.no_grad():
        _, logp, _, _ = trainer.forward(samples)
    samples = prepare_batch([_with_behaviour(group, samples, logp)], RULES, version=0).samples
    before = _completion_logp(trainer, samples)
    trainer.step(samples, sum(int(s.loss_mask.sum()) for s in samples), len(samples))
    delta = _completion_logp(trainer, samples) - before
    assert delta[0] > 0 and delta[2] > 0, delta  # advantage +1
    assert delta[1] < 0 and delta[3] < 0, delta  # advantage -1


SPLITS = [  # (sequences per micro-batch, token budget, packing, activation checkpointing)
    (8, 0, False, False),  # the reference: one padded pass
    (3, 0, False, False),
    (1, 0, True, False),
    (64, 20, False, False),  # length buckets under a padded-token budget
    (64, 40, True, True),  # packed rows under a token budget, layers recomputed in backward
]


@pytest.mark.parametrize("aggregation", list(Aggregation))
def test_gradients_do_not_depend_on_the_split(
    tiny_model_dir: Path, aggregation: Aggregation
) -> None:
    groups = [
        make_group(f"g-acc-{i}", [0.0, 1.0, 2.0, 0.5], turns=1 + i, vocab=256) for i in range(3)
    ]  # (lengths 8, 16, 24)
    samples = prepare_batch(groups, RULES, version=0).samples
    tokens = sum(int(s.loss_mask.sum()) for s in samples)
    grads, counts = [], []
    for micro, budget, packing, recompute in SPLITS:
        scale = ScaleConfig(
            max_tokens_per_micro_batch=budget,
            packing=packing,
            logprob_chunk_tokens=7,
            activation_checkpointing=recompute,
        )
        trainer = _trainer(tiny_model_dir, micro=micro, scale=scale)
        trainer.cfg = OptimConfig(
            **{**trainer.cfg.__dict__, "aggregation": aggregation, "norm_tokens": 16}
        )
        counts.append(len(trainer.my_micro_batches(samples)))
        trainer.step(samples, tokens, len(samples))
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    assert counts == [2, 4, 12, 10, 7]  # the budgets really split the batch differently
    for other in grads[1:]:
        torch.testing.assert_close(grads[0], other, rtol=1e-4, atol=1e-6)
    assert float(grads[0].abs().sum()) > 0


def test_mis_rejected_tokens_leave_the_loss_and_its_denominator(tiny_model_dir: Path) -> None:
    # One sequence whose recorded logprobs are 5 nats below the model's (w = e^5 > C = 2) is
    # masked by MIS: the step's gradient is that of the other sequences trained alone, with
    # their own token count as the denominator (not diluted by the rejected tokens).
    mis = LossConfig(correction=Correction.MIS)
    group = make_group("g-mis", [0.0, 1.0, 1.0, 0.0], vocab=256)
    first = _trainer(tiny_model_dir, terms=mis)
    samples = prepare_batch([group], RULES, version=0).samples
    with torch.no_grad():
        _, logp, _, _ = first.forward(samples)
    own = prepare_batch([_with_behaviour(group, samples, logp)], RULES, version=0).samples
    bad = dataclasses.replace(own[0], behaviour_logp=own[0].behaviour_logp - 5 * own[0].loss_mask)
    stats = first.step([bad, *own[1:]], sum(int(s.loss_mask.sum()) for s in own), len(own))
    assert stats.rejected_fraction == pytest.approx(
        own[0].loss_mask.sum() / sum(s.loss_mask.sum() for s in own)
    )
    alone = _trainer(tiny_model_dir, terms=mis)
    alone.step(own[1:], sum(int(s.loss_mask.sum()) for s in own[1:]), len(own) - 1)
    for a, b in zip(first.model.parameters(), alone.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    assert any(float(p.grad.abs().sum()) > 0 for p in alone.model.parameters())
