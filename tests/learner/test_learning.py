"""Learning, shown with the learner's own code on the farm's data path (in-process, seeded).

`tests/learner/inprocess.py` runs the workers' episode code, sampling from the learner's live
model the way the CPU server does, and trains with the learner's `Core`. Fixed seeds; every
margin below was measured on seeds 0, 1 and 2 (see the constants), and the tests run seed 0.

* The toy task (copy a digit; chance 0.1) with its action vocabulary: the learner trains the
  distribution the workers sample, so the reward rises and the policy's mass moves *onto*
  the allowed digits. Before the fix, the learner trained the unrestricted softmax: the mass
  drained onto a token the workers never sampled (`~`, p ~ 1) and the reward stalled.
* The no-push control: the same run whose sampler keeps the initial weights stays at chance.
* PPO with a critic and GAE learns the toy.
* `lookup`, the two-turn tool task: the answer must copy the tool's observation from the
  episode's second turn. It needs two things the toy does not: the protocol turn samples only
  the call (the worker reads the env's action vocabulary before each turn; when turn 1 could
  draw a digit, that digit sat in the context as a distractor and the reward stalled at
  0.36-0.40 after 200 steps), and an entropy bonus with a decaying lr, which keep the policy
  from collapsing on a wrong digit before it has learned to copy.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.learner.inprocess import Run, train, window_mean

# The toy at 16 prompts x 8 samples, lr 3e-3 after a 10-step warm-up (the demo's settings):
# the 10-step mean reached 0.6 at steps 55, 51 and 57 on seeds 0, 1, 2, and 0.93-0.97 by 80.
TOY = {"learning_rate": 3e-3, "lr_warmup_steps": 10, "micro_batch_size": 64}
TOY_STEPS, GOAL = 75, 0.6
# PPO, critic at the policy's lr: 0.6 at steps 61, 53 and 58 on seeds 0-2 (0.87-0.95 by 75).
PPO = {"algorithm": "ppo", "critic_learning_rate": 3e-3}
# lookup: the same batch, an entropy bonus of 0.03 and the lr decayed (cosine) to 0.1x over
# the run. Its last 10-step mean after 250 steps was 0.89, 0.92 and 0.69 on seeds 0-2 (0.6
# first reached at steps 93, 96 and 108; measured with the batched KV-cache generator and the
# learner's fused AdamW and vocabulary tiles; 0.94 on seed 0 before those). At a constant lr 3e-3 with a 0.01 bonus it was
# 0.69, 0.82, 0.34 (seed 2 collapsed onto wrong digits); with turn 1 free to draw digits,
# 0.36 and 0.40 (seeds 0, 2); with neither the bonus nor the narrowed turn 1, 0.38 (seed 0).
LOOKUP = {
    **TOY,
    "entropy_coef": 0.03,
    "lr_schedule": "cosine",
    "lr_decay_steps": 250,
    "min_lr_ratio": 0.1,
}
LOOKUP_STEPS = 250  # the schedule's length; the test stops at the first window at the goal


def _toy(model: Path, **kw: object) -> Run:
    return train(
        model,
        "toy",
        steps=kw.pop("steps", TOY_STEPS),
        seed=0,
        groups=16,  # type: ignore[arg-type]
        flags={**TOY, **kw.pop("flags", {})},
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_toy_is_learned_and_mass_moves_onto_the_actions(tiny_model_dir: Path) -> None:
    run = _toy(tiny_model_dir)
    windows = window_mean(run.rewards)
    assert windows[0] < 0.2 and max(windows) >= GOAL, f"no learning: {run.rewards}"
    # the random model puts ~95% of its mass outside the ten digits; training the sampled
    # distribution must not drain more there (the old learner drove it to ~100% on "~")
    first, last = run.stats[0].outside_mass, run.stats[-1].outside_mass
    assert last < first - 0.2, (first, last)
    worst = max(s.behaviour_log_ratio_std for s in run.stats)
    assert worst < 1e-3, worst  # on policy: mu = pi


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_weight_push_the_reward_stays_at_chance(tiny_model_dir: Path) -> None:
    # 128 episodes a step at p = 0.1: a 10-step mean has sigma ~0.008
    run = _toy(tiny_model_dir, steps=25, push=False)
    assert statistics.mean(run.rewards[-10:]) < 0.15, run.rewards
    assert run.stats[-1].outside_mass < run.stats[0].outside_mass  # the learner did train


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ppo_with_gae_learns_the_toy(tiny_model_dir: Path) -> None:
    run = _toy(tiny_model_dir, flags=PPO)
    assert max(window_mean(run.rewards)) >= GOAL, f"no learning: {run.rewards}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lookup_is_learned_from_the_tools_observation(tiny_model_dir: Path) -> None:
    run = train(
        tiny_model_dir, "lookup", steps=LOOKUP_STEPS, seed=0, groups=16, flags=LOOKUP, until=GOAL
    )
    windows = window_mean(run.rewards)
    assert windows[0] < 0.2, windows[0]  # chance: the first observation says nothing
    assert windows[-1] >= GOAL, f"lookup not learned: {[round(w, 2) for w in windows[::10]]}"
