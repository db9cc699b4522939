"""Sampling maths against hand-computed cases: greedy, allowed mask, min-p, top-k, top-p nucleus,
vLLM's GPU tie rule, the lowest temperature, seeds, and the processed (renormalised) logprobs
the server reports."""

from __future__ import annotations

import math

import pytest
import torch

from broker.messages import Sampling
from inference.sampling import RowSampling, SampleSpec, keep_cut, processed_logits, sample_rows


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
    kept = ~keep_cut(z, rows).dropped(z)
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


def _kept(logits: list[float], *samplings: Sampling) -> list[list[int]]:
    """The kept token ids of each sampling on the same logits."""
    z = torch.tensor([logits] * len(samplings))
    processed = processed_logits(z, RowSampling.of(list(samplings), len(logits)))
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in processed]


def test_top_k_keeps_exactly_k_the_lowest_indices_first_among_ties() -> None:
    # sorted: 3 (id 4), then 2 tied four times (ids 1, 2, 5, 6), then 1 (id 0) and 0 (id 3)
    logits = [1.0, 2.0, 2.0, 0.0, 3.0, 2.0, 2.0]
    assert _kept(logits, Sampling(top_k=1), Sampling(top_k=3), Sampling(top_k=5)) == [
        [4],
        [1, 2, 4],
        [1, 2, 4, 5, 6],
    ]
    # min-p first (exp(-1.5) keeps z >= 1.5), then top-k: ties the floor itself keeps all
    assert _kept(logits, Sampling(top_k=6, min_p=math.exp(-1.5))) == [[1, 2, 4, 5, 6]]
    # fewer allowed tokens than k: top-k keeps them all
    assert _kept(logits, Sampling(top_k=3, allowed_token_ids=[0, 3])) == [[0, 3]]


def test_top_p_keeps_only_the_tied_tokens_its_mass_needs() -> None:
    # four tokens tied at probability 0.2 each behind one at 0.2 * e
    logits = [0.0, 0.0, 1.0, 0.0, 0.0]
    share = math.e / (math.e + 4)  # 0.405; each tied token 0.149
    cases = [Sampling(top_p=share - 0.01), Sampling(top_p=share + 0.01), Sampling(top_p=0.71)]
    # the top token alone; with one tie 0.554 >= 0.415; two reach 0.702 < 0.71, three 0.851
    assert _kept(logits, *cases) == [[2], [0, 2], [0, 1, 2, 3]]
    # top-k trims the ties first, top-p then takes from what top-k kept
    assert _kept(logits, Sampling(top_k=3, top_p=0.99)) == [[0, 1, 2]]
    # a tie at the top (0.297 each): as many as reach p, lowest index first
    assert _kept([0.0, 1.0, 1.0, 1.0], Sampling(top_p=0.25), Sampling(top_p=0.5)) == [[1], [1, 2]]


def test_a_temperature_below_vllms_floor_samples_at_it_and_only_zero_is_greedy() -> None:
    """vLLM's SamplingParams raises a temperature in (0, 0.01) to 0.01; 1e-6 is not greedy."""
    assert Sampling(0.004).temperature == 0.01 and not Sampling(1e-6).greedy
    assert Sampling(0.0).greedy and Sampling(0.01).temperature == 0.01
    logits = torch.tensor([[0.0, 0.01, 0.02]]).repeat(2, 1)
    rows = RowSampling.of([Sampling(1e-6), Sampling(0.01)], 3)
    torch.testing.assert_close(processed_logits(logits, rows)[0], processed_logits(logits, rows)[1])
    # sampled at 0.01 (logits x 100: 0, 1, 2), top-k 2 keeps {1, 2}; greedy would report the
    # argmax at temperature 1, untruncated (-1.09)
    tokens, logprobs, _ = sample_rows(logits[:1], [spec(1e-6, top_k=2)], [None])
    assert logprobs[0] == pytest.approx(tokens[0] - math.log(math.e + math.e**2), abs=1e-5)
