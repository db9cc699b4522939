"""Loss terms on the real tiny model: proximal recompute, epochs and mini-batches, KL, entropy, critic."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.messages import Trajectory, TrajectoryGroup, Turn
from learner.algorithms import Algorithm
from learner.batch import BatchRules, Sample, prepare_batch
from learner.config import LearnerConfig, LossConfig, Overlong
from learner.core import Core, build_core
from learner.critic import CriticConfig, load_critic, restore_critic, save_critic, token_rewards
from learner.distributed import DistContext
from learner.reference import Reference, kl_token_penalties
from learner.scoring import sequence_logprobs
from learner.trainer import Trainer
from tests.learner.factories import make_group
from tests.learner.test_trainer import _trainer, optim

RULES = BatchRules(Algorithm.GRPO, 1.0, max_staleness=4, skip_zero_variance=False)


def _on_policy(trainer: Trainer, group: TrajectoryGroup, rules: BatchRules = RULES) -> list[Sample]:
    """The group's samples with behaviour logprobs replaced by the model's own."""
    samples = prepare_batch([group], rules, version=0).samples
    own = sequence_logprobs(trainer.model, samples, trainer.scoring)
    return [
        dataclasses.replace(s, behaviour_logp=(p * s.loss_mask).astype(np.float32))
        for s, p in zip(samples, own, strict=True)
    ]


def _tokens(samples: list[Sample]) -> int:
    return int(sum(s.loss_mask.sum() for s in samples))


def test_proximal_logprobs_are_recomputed_before_several_updates(tiny_model_dir: Path) -> None:
    terms = LossConfig(ppo_epochs=2, mini_batches=2)
    trainer = _trainer(tiny_model_dir, lr=1e-2, terms=terms)
    samples = _on_policy(trainer, make_group("g-epochs", [1.0, 0.0, 1.0, 0.0], vocab=256))
    shares = trainer.prepare(samples)
    assert [len(local) for local, _, _ in shares] == [2, 2]
    for local, _, _ in shares:  # pi_prox: the weights before the first update
        for s in local:
            on = s.loss_mask > 0
            np.testing.assert_allclose(s.prox_logp[on], s.behaviour_logp[on], atol=1e-6)
    first = trainer.step(*shares[0])
    assert first.ratio_min == pytest.approx(1.0, abs=1e-5)
    assert first.ratio_max == pytest.approx(1.0, abs=1e-5)
    stats = trainer.update(samples)  # 2 epochs x 2 mini-batches, prox fixed meanwhile
    # a mini-batch whose every token the clip holds has an exactly-zero gradient: not taken
    assert stats.optimizer_steps + stats.zero_gradient_steps == 4
    assert stats.optimizer_steps >= 2
    assert stats.ratio_max > 1.0 + 1e-4 or stats.ratio_min < 1.0 - 1e-4
    assert 0.0 <= stats.clip_fraction <= 1.0


def test_kl_loss_is_zero_at_the_start_and_grows_as_the_policy_moves(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = Reference(ref_model, torch.device("cpu"), offload=True)
    trainer = _trainer(tiny_model_dir, lr=3e-2, terms=LossConfig(kl_coef=0.1), reference=reference)
    samples = _on_policy(trainer, make_group("g-kl", [1.0, 0.0, 1.0, 0.0], vocab=256))
    first = trainer.update(samples)
    assert first.kl == 0.0  # k3 of identical policies
    second = trainer.update(samples)
    assert second.kl > 0.0
    assert all(not p.requires_grad for p in ref_model.parameters())


def test_entropy_bonus_raises_entropy_without_advantages(tiny_model_dir: Path) -> None:
    flat = make_group("g-flat", [1.0, 1.0, 1.0, 1.0], vocab=256)  # GRPO advantages all 0
    still = _trainer(tiny_model_dir, lr=1e-2)
    samples = _on_policy(still, flat)
    assert still.update(samples).grad_norm == 0.0  # nothing to learn without the bonus
    trainer = _trainer(tiny_model_dir, lr=1e-2, terms=LossConfig(entropy_coef=1.0))
    before = trainer.update(samples)
    assert before.grad_norm > 0.0
    after = trainer.update(samples)
    assert after.entropy > before.entropy


def test_reference_and_critic_are_built_only_when_asked(tiny_model_dir: Path) -> None:
    cpu, dist = torch.device("cpu"), DistContext()

    def core(**flags: object) -> Core:
        return build_core(
            LearnerConfig.load({"model": tiny_model_dir, **flags}, environ={}), dist, cpu
        )

    plain = core()
    assert plain.trainer.reference is None and plain.reference is None and plain.critic is None
    loss = core(kl_coef=0.1)
    assert loss.trainer.reference is not None and loss.reference is None
    reward = core(kl_coef=0.1, kl_mode="reward")
    assert reward.trainer.reference is None and reward.reference is not None
    ppo = core(algorithm="ppo")
    assert ppo.critic is not None


def _three_turns(reward_turns: list[float], version: int = 0) -> Trajectory:
    rng = np.random.default_rng(len(reward_turns))
    turns = tuple(
        Turn(
            rng.integers(0, 256, 3),
            rng.integers(0, 256, 2),
            [-2.0, -2.0],
            version,
            r,
            k == 2,
            False,
        )
        for k, r in enumerate(reward_turns)
    )
    return Trajectory(turns, "terminated")


def test_critic_gae_on_a_three_turn_episode_and_value_learning(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    g = make_group("g-ppo", [0.0, 0.0])
    group = TrajectoryGroup(
        "g-ppo",
        g.task,
        (
            _three_turns([0.5, 0.0, 1.0]),
            dataclasses.replace(_three_turns([0.0, 0.0, 0.0]), sample_index=1),
        ),
        "w",
    )
    samples = prepare_batch([group], dataclasses.replace(RULES, algorithm=Algorithm.PPO), 0).samples
    # turn rewards on each turn's last completion token: 3 prompt + 2 completion tokens a turn
    assert np.flatnonzero(token_rewards(samples[:1])).tolist() == [4, 14]
    cfg = CriticConfig(learning_rate=2e-3, value_clip=10.0, gamma=1.0, lam=1.0)
    critic = load_critic(tiny_model_dir, cfg, optim(1e-3), torch.device("cpu"), DistContext())
    annotated = critic.annotate(samples)
    # a zero-initialised head gives V = 0, so with gamma = lambda = 1 the returns are the
    # rewards still to come: turn 1 tokens 1.5, turn 2 tokens 1.0, turn 3 tokens 1.0
    on = samples[0].loss_mask > 0
    assert annotated[0].returns[on].tolist() == [1.5, 1.5, 1.0, 1.0, 1.0, 1.0]
    assert annotated[1].returns[samples[1].loss_mask > 0].tolist() == [0.0] * 6
    adv = np.concatenate([a.advantages[a.loss_mask > 0] for a in annotated])
    assert abs(adv.mean()) < 1e-6 and adv.std() == pytest.approx(1.0, rel=1e-4)  # whitened
    # V = 0 at first: loss = mean 0.5 R^2 = 0.5 (2 * 2.25 + 4 * 1) / 12 = 0.354; the best
    # constant (the mean return) already takes it to 0.5 var(R) = 0.184
    losses = [critic.update(annotated, epochs=1, mini_batches=1) for _ in range(10)]
    assert losses[0] == pytest.approx(0.5 * 8.5 / 12, rel=1e-5)
    assert losses[-1] < 0.6 * losses[0], losses
    # the trained critic survives a checkpoint; a step without one starts afresh
    save_critic(critic, tmp_path, step=7, keep=1)
    again = load_critic(tiny_model_dir, cfg, optim(1e-3), torch.device("cpu"), DistContext())
    assert not restore_critic(again, tmp_path, step=6)
    assert restore_critic(again, tmp_path, step=7)
    for mine, theirs in zip(critic.estimate(samples), again.estimate(samples), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert np.abs(critic.estimate(samples)[0]).max() > 0  # trained, not the zero head


def test_the_critic_bootstraps_a_truncated_episode_from_the_state_after_it(
    tiny_model_dir: Path,
) -> None:
    # The same three turns, once terminated and once cut by --max-turns. A head with bias 0.5
    # and zero weights makes V = 0.5 everywhere, after the last token too; with gamma =
    # lambda = 1 a return is the reward still to come, plus 0.5 when the episode was cut.
    cut = dataclasses.replace(
        _three_turns([0.5, 0.0, 1.0]), finish_reason="truncated", truncation="max_turns"
    )
    g = make_group("g-cut", [0.0, 0.0])
    episodes = (_three_turns([0.5, 0.0, 1.0]), dataclasses.replace(cut, sample_index=1))
    group = TrajectoryGroup("g-cut", g.task, episodes, "w")
    samples = prepare_batch([group], dataclasses.replace(RULES, algorithm=Algorithm.PPO), 0).samples
    cfg = CriticConfig(learning_rate=1e-3, value_clip=10.0, gamma=1.0, lam=1.0)
    critic = load_critic(tiny_model_dir, cfg, optim(1e-3), torch.device("cpu"), DistContext())
    torch.nn.init.constant_(critic.head.bias, 0.5)
    annotated = critic.annotate(samples)
    ended, truncated = (a.returns[a.loss_mask > 0].tolist() for a in annotated)
    assert ended == pytest.approx([1.5, 1.5, 1.0, 1.0, 1.0, 1.0])
    assert truncated == pytest.approx([2.0, 2.0, 1.5, 1.5, 1.5, 1.5])


def test_defect_d4_an_overlong_masked_episode_is_penalised_in_the_baseline(
    tiny_model_dir: Path,
) -> None:
    # KL as a reward penalty with DAPO's overlong mask: the masked episode trains nothing,
    # but its return enters the group baseline, so it must carry its KL penalty there too.
    core = build_core(
        LearnerConfig.load(
            {"model": tiny_model_dir, "kl_coef": 0.5, "kl_mode": "reward", "overlong": "mask"},
            environ={},
        ),
        DistContext(),
        torch.device("cpu"),
    )
    assert core.reference is not None

    def episode(reward: float, tokens: int, truncation: str | None = None) -> Trajectory:
        turn = Turn([1, 2], list(range(3, 3 + tokens)), [-1.0] * tokens, 0, reward, True, False)
        finish = "truncated" if truncation else "terminated"
        return Trajectory((turn,), finish, truncation=truncation)  # type: ignore[arg-type]

    task = make_group("d4", [0.0, 0.0, 0.0]).task
    episodes = (episode(1.0, 6, "context"), episode(1.0, 2), episode(0.0, 2))
    group = TrajectoryGroup(
        "d4",
        task,
        tuple(dataclasses.replace(e, sample_index=i) for i, e in enumerate(episodes)),
        "w",
    )
    prepared = core.prepare([group], replay=False)
    assert [s.episode for s in prepared.samples] == [1, 2]
    rules = core.cfg.batch
    every = prepare_batch(
        [group], dataclasses.replace(rules, overlong=Overlong.NONE, skip_zero_variance=False), 0
    )
    penalties = kl_token_penalties(
        core.reference, every.samples, core.trainer.scoring, core.cfg.loss.kl_estimator, 0.5
    )
    assert sum(float(np.abs(p).sum()) for p in penalties[("d4", 0)].values()) > 0.1
    unpenalised = {k: v for k, v in penalties.items() if k != ("d4", 0)}
    wrong = prepare_batch([group], rules, 0, unpenalised)
    right = prepare_batch([group], rules, 0, penalties)
    got = [s.advantages[s.loss_mask > 0][0] for s in prepared.samples]
    assert got == pytest.approx([s.advantages[s.loss_mask > 0][0] for s in right.samples])
    assert got != pytest.approx([s.advantages[s.loss_mask > 0][0] for s in wrong.samples])


def test_the_learning_rate_follows_the_schedule_step_by_step(tiny_model_dir: Path) -> None:
    core = build_core(
        LearnerConfig.load(
            {"model": tiny_model_dir, "learning_rate": 1e-3, "lr_warmup_steps": 2}, environ={}
        ),
        DistContext(),
        torch.device("cpu"),
    )
    seen = []
    for k in range(3):
        core.train([make_group(f"lr{k}")], replay=False)
        seen.append(core.trainer.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3])
