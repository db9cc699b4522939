"""The CPU server reports what vLLM 0.33's sampler reports in processed_logprobs mode.

vLLM's own V1 `Sampler` runs on the same logits (in a process with the contract environment),
for every combination of allowed tokens, temperature (greedy and a temperature vLLM raises to
0.01 included, alone and mixed with sampled rows), min-p, top-k and top-p; `inference.sampling`
must keep the same tokens and give the same logprobs, and the server's reported logprob of each
sampled token must be vLLM's. This checks the order of the steps and their maths on vLLM's
PyTorch top-k/top-p path (its path without Triton, as on this CPU) with float32 Gaussian logits,
where no tie falls on a boundary: ties are where that path and vLLM's GPU kernels part, and
test_vllm_gpu_sampler.py checks them against the GPU kernels, the rule we follow.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from broker.messages import Sampling
from inference.sampling import RowSampling, SampleSpec, processed_logits, sample_rows
from tests.inference.vllm_contract.sampler import vllm_processed

VOCAB = 40


def _cases() -> tuple[list[Sampling], list[float]]:
    """The rows, and the temperature each request asks for."""
    allowed = [None, [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37], [4]]
    grid = list(
        itertools.product(
            (0.0, 0.004, 0.6, 1.0, 1.7), (0, 1, 6, 100), (1.0, 0.9, 0.35), (0.0, 0.08), allowed
        )
    )
    return [Sampling(t, k, p, m, a) for t, k, p, m, a in grid], [t for t, *_ in grid]


def _logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((rows, VOCAB), generator=gen) * 3.0


# e^-87.3 is float32's smallest normal number. In a batch where any row uses top-p, vLLM's
# PyTorch path drops the tokens whose float32 probability underflows to 0 even at top-p 1 (its
# cumulative sum is then `<= 1 - p`); the GPU kernels skip rows at top-p 1, and so do we. Such
# tokens (at temperature 0.01 here) are never drawn: below this logprob, kept or not is moot.
UNDERFLOW = -87.0


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    drawable = ours > UNDERFLOW
    assert torch.equal(torch.isinf(ours) | ~drawable, torch.isinf(theirs) | ~drawable), (
        "a different kept set"
    )
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=0, atol=2e-5)


@pytest.mark.slow
def test_processed_logprobs_match_vllms_sampler_for_every_combination() -> None:
    rows, temperatures = _cases()
    logits = _logits(len(rows), 0)
    theirs = vllm_processed(logits, rows, temperatures)
    ours = torch.log_softmax(processed_logits(logits, RowSampling.of(rows, VOCAB)), dim=-1)
    _same(ours, theirs)
    # The server reports vLLM's processed logprob of whatever token it draws, and its top ones.
    specs = [SampleSpec(s, 3) for s in rows]
    tokens, reported, tops = sample_rows(logits, specs, [None] * len(rows))
    expected = theirs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(reported), expected, rtol=0, atol=2e-5)
    assert all(torch.isfinite(expected)), "a token drawn outside vLLM's kept set"
    for i, top in enumerate(tops):
        values = torch.tensor([v for _, v in top])
        drawable = values > UNDERFLOW
        want = theirs[i].topk(3).values.clamp(min=-9999.0)
        torch.testing.assert_close(values[drawable], want[drawable], atol=2e-5, rtol=0)


@pytest.mark.slow
def test_an_all_greedy_batch_matches_too() -> None:
    """vLLM returns an all-greedy batch's logprobs before temperature and truncation."""
    rows = [Sampling(0.0, allowed_token_ids=[2, 9]), Sampling(0.0), Sampling(0.0, top_p=0.5)]
    logits = _logits(len(rows), 1)
    theirs = vllm_processed(logits, rows)
    _same(torch.log_softmax(processed_logits(logits, RowSampling.of(rows, VOCAB)), -1), theirs)
