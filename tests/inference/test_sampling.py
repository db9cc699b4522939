"""Sampling maths against hand-computed cases: greedy, allowed mask, min-p, top-k, top-p nucleus,
seeds, and the processed (renormalised) logprobs the server reports."""

from __future__ import annotations

import math

import torch

from broker.messages import Sampling
from inference.sampling import RowSampling, SampleSpec, keep_threshold, sample_rows


def spec(
    temperature: float = 1.0,
    *,
    top_p: float = 1.0,
    allowed: list[int] | None = None,
    k: int = 0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> SampleSpec:
    return SampleSpec(Sampling(temperature, top_k, top_p, min_p, allowed), k)


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_and_allowed_report_the_renormalised_distribution() -> None:
    rows = LOGITS.repeat(2, 1)
    tokens, logprobs, tops = sample_rows(
        rows, [spec(0.0), spec(0.0, allowed=[2, 3], k=2)], [None, None]
    )
    assert tokens == [0, 2]
    # vLLM's processed logprobs: renormalised over the allowed set {0.15, 0.05}.
    assert math.isclose(logprobs[1], math.log(0.15 / 0.2), rel_tol=1e-5)
    assert tops[0] == [] and [t for t, _ in tops[1]] == [2, 3]
    # A token outside the allowed set is reported at vLLM's floor, not as -inf.
    _, _, three = sample_rows(rows[:1], [spec(0.0, allowed=[2, 3], k=3)], [None])
    assert three[0][2][1] == -9999.0


def test_logprobs_are_at_the_sampling_temperature_within_the_nucleus() -> None:
    tokens, logprobs, tops = sample_rows(LOGITS[None], [spec(2.0, top_p=0.5, k=1)], [None])
    tempered = torch.softmax(LOGITS / 2.0, dim=-1)  # 0.345, 0.267, 0.189, 0.105 (rounded)
    # At T=2 the top token alone (0.345) does not reach 0.5, the top two (0.612) do: the
    # nucleus is {0, 1}, and the reported logprob is renormalised over it.
    nucleus = tempered[:2].sum()
    assert tokens[0] in (0, 1)
    assert math.isclose(logprobs[0], math.log(tempered[tokens[0]] / nucleus), rel_tol=1e-5)
    assert math.isclose(tops[0][0][1], math.log(tempered[0] / nucleus), rel_tol=1e-5)


def test_min_p_and_top_k_thresholds() -> None:
    rows = RowSampling.of(
        [
            Sampling(min_p=0.25),
            Sampling(top_k=3),
            Sampling(top_k=2, min_p=0.5),
            Sampling(0.0, top_k=1),
        ],
        4,
    )
    z = LOGITS.repeat(4, 1)
    kept = z >= keep_threshold(z, rows).unsqueeze(1)
    # min_p 0.25: p >= 0.125 keeps {0.5, 0.3, 0.15}; top_k 3 the same three; top_k 2 with
    # min_p 0.5 keeps p >= 0.25 and the top two: {0.5, 0.3}; a greedy row is never truncated.
    assert kept.tolist() == [
        [True, True, True, False],
        [True, True, True, False],
        [True, True, False, False],
        [True, True, True, True],
    ]


def test_top_p_keeps_only_the_nucleus() -> None:
    # top_p 0.7: {0.5, 0.3} reaches 0.8 >= 0.7, so only tokens 0 and 1 can be drawn.
    rows = LOGITS.repeat(400, 1)
    tokens, logprobs, _ = sample_rows(rows, [spec(top_p=0.7)] * 400, [None] * 400)
    assert set(tokens) == {0, 1}
    share = tokens.count(0) / 400
    assert 0.5 < share < 0.75  # 0.5 / 0.8 = 0.625 after renormalisation
    assert math.isclose(logprobs[tokens.index(1)], math.log(0.3 / 0.8), rel_tol=1e-5)
    tokens, logprobs, _ = sample_rows(LOGITS.repeat(50, 1), [spec(top_p=0.4)] * 50, [None] * 50)
    assert set(tokens) == {0}  # the first token alone already passes 0.4
    assert logprobs[0] == 0.0  # the nucleus is one token: probability 1


def test_seeded_rows_repeat_and_temperature_flattens() -> None:
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]
    a, _, _ = sample_rows(LOGITS.repeat(2, 1), [spec(), spec()], gens)
    again = [torch.Generator().manual_seed(3) for _ in range(2)]
    b, _, _ = sample_rows(LOGITS.repeat(2, 1), [spec(), spec()], again)
    assert a == b
    hot, _, _ = sample_rows(LOGITS.repeat(2000, 1), [spec(temperature=50.0)] * 2000, [None] * 2000)
    assert hot.count(3) > 300  # nearly uniform at high temperature (0.05 -> ~0.25)
