"""Sampling maths against hand-computed cases: greedy, allowed mask, top-p nucleus, seeds, raw logprobs."""

from __future__ import annotations

import math

import torch

from inference.sampling import SampleSpec, sample_rows


def spec(
    temperature: float = 1.0, top_p: float = 1.0, allowed: list[int] | None = None, k: int = 0
) -> SampleSpec:
    return SampleSpec(temperature, top_p, torch.tensor(allowed) if allowed else None, k)


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_allowed_and_raw_logprobs() -> None:
    rows = LOGITS.repeat(2, 1)
    tokens, logprobs, tops = sample_rows(
        rows, [spec(0.0), spec(0.0, allowed=[2, 3], k=2)], [None, None]
    )
    assert tokens == [0, 2]
    # Reported logprobs are the raw model's, not renormalised over the allowed set.
    assert math.isclose(logprobs[1], math.log(0.15), rel_tol=1e-5)
    assert tops[0] == [] and [t for t, _ in tops[1]] == [0, 1]


def test_logprobs_are_at_the_sampling_temperature() -> None:
    tokens, logprobs, tops = sample_rows(LOGITS[None], [spec(2.0, top_p=0.5, k=1)], [None])
    tempered = torch.log_softmax(LOGITS / 2.0, dim=-1)
    # at temperature 2, not renormalised over the top-p nucleus (which may hold two tokens
    # at this temperature: the sampled one is compared with its own tempered logprob)
    assert math.isclose(tops[0][0][1], float(tempered[0]), rel_tol=1e-6)
    assert math.isclose(logprobs[0], float(tempered[tokens[0]]), rel_tol=1e-6)


def test_top_p_keeps_only_the_nucleus() -> None:
    # top_p 0.7: {0.5, 0.3} reaches 0.8 >= 0.7, so only tokens 0 and 1 can be drawn.
    rows = LOGITS.repeat(400, 1)
    tokens, _, _ = sample_rows(rows, [spec(top_p=0.7)] * 400, [None] * 400)
    assert set(tokens) == {0, 1}
    share = tokens.count(0) / 400
    assert 0.5 < share < 0.75  # 0.5 / 0.8 = 0.625 after renormalisation
    tokens, _, _ = sample_rows(LOGITS.repeat(50, 1), [spec(top_p=0.4)] * 50, [None] * 50)
    assert set(tokens) == {0}  # the first token alone already passes 0.4


def test_seeded_rows_repeat_and_temperature_flattens() -> None:
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]
    a, _, _ = sample_rows(LOGITS.repeat(2, 1), [spec(), spec()], gens)
    again = [torch.Generator().manual_seed(3) for _ in range(2)]
    b, _, _ = sample_rows(LOGITS.repeat(2, 1), [spec(), spec()], again)
    assert a == b
    hot, _, _ = sample_rows(LOGITS.repeat(2000, 1), [spec(temperature=50.0)] * 2000, [None] * 2000)
    assert hot.count(3) > 300  # nearly uniform at high temperature (0.05 -> ~0.25)
