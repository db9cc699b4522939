"""A real pretrained model learns a task it fails: SmolLM2-135M-Instruct on `arith`, in-process.

`arith` asks "What is a+b? Answer with the number only." and pays 1 when the answer is the
last thing the reply says. The base model mostly rambles past the number until the 12-token
turn is cut, or talks around it. GRPO (4 prompts x 8 samples a step, lr 2e-5, temperature 1)
on the train split teaches it to answer and stop; the score is taken on the held-out split
(problems never trained on, each listed once by row), k = 4 samples of each, before and
after 5 steps. Seeds 0, 1, 2 measured (BENCHMARKS.md, "SmolLM2 on arith"); the test runs
seed 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.arith import split_lines
from tests.learner.inprocess import Score, before_and_after
from workers.config import EpisodeSettings

SETTINGS = EpisodeSettings(max_tokens=12, temperature=1.0)
FLAGS = {"learning_rate": 2e-5, "micro_batch_size": 8}
STEPS, K = 5, 4
# held-out mean@4, one thread (the same run on any machine), base 0.0625 (pass@4 0.25) ->
# after 5 steps 0.60 (0.80), 0.625 (0.85) and 0.6625 (0.85) on seeds 0, 1, 2, each ~3 min
# under quiet (2026-11-27; BENCHMARKS.md, "SmolLM2 on arith"; the same scores on the lean
# generator, 147-178 s, 2026-11-28). On torch's two threads beside
# the suite's other worker the same test took 809 s: the threads spun against each other.
BASE_BELOW, RISE = 0.15, 0.3
SEED = 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_learns_to_answer_and_stop_on_held_out_problems(smollm2_dir: Path) -> None:
    base, after, rewards = run_seed(smollm2_dir, SEED)
    assert base.mean < BASE_BELOW, base
    assert after.mean >= base.mean + RISE, (base, after, rewards)
    assert after.pass_at_k > base.pass_at_k, (base, after)


def run_seed(smollm2_dir: Path, seed: int) -> tuple[Score, Score, list[float]]:
    """The held-out score before and after `STEPS` steps of seed `seed`, and the rewards."""
    heldout = split_lines("heldout")
    return before_and_after(
        smollm2_dir, "arith", heldout, steps=STEPS, seed=seed, k=K, flags=FLAGS, settings=SETTINGS
    )
