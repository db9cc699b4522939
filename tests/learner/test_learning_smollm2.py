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
from tests.learner.inprocess import Score, evaluate, train
from workers.config import EpisodeSettings

SETTINGS = EpisodeSettings(max_tokens=12, temperature=1.0)
FLAGS = {"learning_rate": 2e-5, "micro_batch_size": 8}
STEPS, K = 5, 4
# held-out mean@4, base 0.0875 (pass@4 0.30) -> after 5 steps: 0.60 (0.85), 0.50 (0.90) and
# 0.65 (0.80) on seeds 0, 1, 2; after 8 steps 0.83 and 0.74 on seeds 1 and 2 (the suite's time
# budget chose 5). Those were scored on seeds searched to draw each problem once; scored by
# row (issue 39) seed 0 passes too (2 min under quiet, 2026-11-27).
BASE_BELOW, RISE = 0.15, 0.3


def _score(model: object, model_dir: Path) -> Score:
    """Every held-out problem once (addressed by row: `split_lines`), k samples each."""
    return evaluate(model, model_dir, split_lines("heldout"), k=K, settings=SETTINGS)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_learns_to_answer_and_stop_on_held_out_problems(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = _score(AutoModelForCausalLM.from_pretrained(smollm2_dir).eval(), smollm2_dir)
    run = train(
        smollm2_dir,
        "arith",
        steps=STEPS,
        seed=0,
        groups=4,
        group_size=8,
        flags=FLAGS,
        settings=SETTINGS,
        threads=None,
    )
    assert run.core is not None
    after = _score(run.core.trainer.model.eval(), smollm2_dir)
    assert base.mean < BASE_BELOW, base
    assert after.mean >= base.mean + RISE, (base, after, run.rewards)
    assert after.pass_at_k > base.pass_at_k, (base, after)
