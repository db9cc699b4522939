"""The CPU server and the learner keep what vLLM 0.33 keeps on a GPU, ties included.

vLLM's own GPU sampling kernels (Model Runner V2's temperature, min-p and logprob kernels, and
the Triton top-k/top-p kernels of ``vllm/v1/sample/ops/topk_topp_triton.py``) run in Triton's
interpreter on bf16-rounded logits with deliberate ties, for top-k, top-p, min-p and their
mixes, an allowed-token set, greedy rows and the lowest temperatures. Two CUDA dispatches are
checked (tests/inference/vllm_contract/gpu_sampler.py): a batch of at most 64 rows, where a
top-p row without top-k goes through the split pipeline, and a larger one, where every row
goes through the monolithic kernel.

What vLLM's kernels do with ties (the rule `inference.sampling` implements): top-k keeps
exactly k, the lowest vocabulary indices first among the tokens tied at the k-th value; top-p
keeps the tokens whose mass before them, in (probability descending, index ascending) order,
is below p: only as many boundary ties as the mass needs. The split pipeline applies it
exactly on these rows. The monolithic kernel finds the boundary ties by turning a probability
back into a logit (``log(p * sum) + max``) and comparing within 1e-9, which float rounding
sometimes misses; it then keeps every boundary tie. So where top-p runs in the monolithic
kernel, vLLM keeps our set or our set plus the rest of its boundary tie, nothing else; and at
temperature 0.01 its standalone top-p underflows (a sum of exponentials of about -1600) and
keeps the whole row. (A third departure, when the nucleus reaches a row's smallest finite
logit, needs few finite tokens and is left to scripts/gpu_sampler_check.sh.) We follow the
rule, not those accidents (docs/learner.md, "Ties").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker.messages import Sampling
from inference.sampling import RowSampling, SampleSpec, processed_logits, sample_rows
from learner.distribution import merged
from learner.logprobs import chunked_logprobs
from tests.inference.vllm_contract.triton_sampler import vllm_gpu_processed

VOCAB = 256
ALLOWED = list(range(3, VOCAB, 8))  # 32 tokens
NUM_SM = 132  # an H100: 24 rows get 4 slices of 64 tokens each in the split pipeline
# (temperature, top_k, top_p, min_p, allowed), as a client sends them
CASES = [
    (1.0, 1, 1.0, 0.0, None),
    (1.0, 4, 1.0, 0.0, None),
    (0.7, 12, 1.0, 0.0, None),
    (1.0, 0, 0.3, 0.0, None),
    (1.0, 0, 0.75, 0.0, None),
    (1.6, 0, 0.95, 0.0, None),
    (0.3, 0, 0.9, 0.0, None),
    (1.0, 0, 0.5, 0.0, None),
    (1.0, 0, 1.0, 0.1, None),
    (1.0, 8, 0.8, 0.0, None),
    (1.3, 6, 1.0, 0.05, None),
    (0.8, 0, 0.9, 0.05, None),
    (1.0, 10, 0.9, 0.02, None),
    (1.0, 40, 0.7, 0.0, ALLOWED),  # top-k above the allowed count: a no-op
    (1.0, 5, 1.0, 0.0, ALLOWED),
    (0.6, 0, 0.8, 0.0, ALLOWED),
    (0.0, 4, 0.5, 0.1, None),  # greedy: vLLM resets the truncation
    (0.0, 0, 1.0, 0.0, ALLOWED),
    (0.005, 0, 0.9, 0.0, None),  # vLLM samples at 0.01
    (0.005, 3, 1.0, 0.0, None),
    (0.01, 20, 0.95, 0.0, None),
    (1e-6, 0, 0.6, 0.0, None),  # not greedy: 0.01 too
    (1.0, 2, 1.0, 0.0, None),
    (1.2, 0, 0.6, 0.0, None),
]
REQUESTS = [
    {"temperature": t, "top_k": k, "top_p": p, "min_p": m, "allowed": a} for t, k, p, m, a in CASES
]
SAMPLINGS = [Sampling(t, k, p, m, a) for t, k, p, m, a in CASES]


def _logits() -> torch.Tensor:
    """Logits on a grid of 1/8 (exact in bf16; a model's bf16 logits tie as often over its far
    larger vocabulary), and in each row the value at rank 1, 3 or 6 copied to two columns in
    other quarters of the vocabulary (the split pipeline's slices)."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn((len(CASES), VOCAB), generator=gen) * 16.0).round() / 8.0
    for i, row in enumerate(logits):
        value = row.sort(descending=True).values[(0, 2, 5)[i % 3]]
        row[[(40 + 67 * i) % VOCAB, (170 + 31 * i) % VOCAB]] = value
    assert torch.equal(logits.bfloat16().float(), logits)
    return logits


LOGITS = _logits()


@pytest.fixture(scope="module")
def vllm_gpu() -> tuple[list[float], dict[str, torch.Tensor]]:
    return vllm_gpu_processed(LOGITS, REQUESTS, ("small", "large"), NUM_SM)


def _ours() -> torch.Tensor:
    return torch.log_softmax(processed_logits(LOGITS, RowSampling.of(SAMPLINGS, VOCAB)), dim=-1)


def _mono_top_p(s: Sampling, batch: str) -> bool:
    """Whether vLLM runs this row's top-p in the monolithic kernel."""
    return not s.greedy and s.top_p < 1.0 and (batch == "large" or 0 < s.top_k < VOCAB)


def _allowed(s: Sampling) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[torch.from_numpy(s.allowed_token_ids).long()] = True
    return mask


def _boundary_ties_only(ours: torch.Tensor, theirs: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether `theirs` keeps `ours` plus only tokens tied with our smallest kept logit."""
    extra = torch.isfinite(theirs) & ~torch.isfinite(ours)
    floor = row[torch.isfinite(ours)].min()
    return bool(torch.isfinite(theirs[torch.isfinite(ours)]).all() and (row[extra] == floor).all())


def _same_row(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    if not torch.equal(torch.isfinite(ours), torch.isfinite(theirs)):
        return False
    finite = torch.isfinite(theirs)
    return bool(torch.allclose(ours[finite], theirs[finite], rtol=0, atol=2e-5))


@pytest.mark.slow
def test_temperatures_are_the_ones_vllm_samples_at(vllm_gpu) -> None:
    temperatures, _ = vllm_gpu
    assert temperatures == pytest.approx([s.temperature for s in SAMPLINGS], abs=0)
    assert sum(t == 0.01 for t in temperatures) == 4  # 0.005 and 1e-6 raised, 0.01 kept


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["small", "large"])
def test_kept_sets_and_logprobs_are_vllms_gpu_ones(vllm_gpu, batch: str) -> None:
    theirs = vllm_gpu[1][batch]
    ours = _ours()
    partial = 0  # rows where vLLM keeps only part of the tie at its boundary
    for i, s in enumerate(SAMPLINGS):
        kept = torch.isfinite(theirs[i])
        left = ~kept if s.allowed_token_ids is None else ~kept & _allowed(s)
        partial += int((LOGITS[i][kept].min() <= LOGITS[i][left]).any())
        if _same_row(ours[i], theirs[i]):
            continue
        assert _mono_top_p(s, batch), f"row {i} {s}: kept sets differ in an exact path"
        underflow = batch == "large" and s.temperature == 0.01 and not s.top_k
        assert underflow or _boundary_ties_only(ours[i], theirs[i], LOGITS[i] / s.temperature), i
        if underflow:
            assert bool(kept.all()), f"row {i}: the known underflow keeps every token"
    assert partial >= 6, "the logits must make vLLM split ties for the test to mean anything"


def _exact_rows(theirs: torch.Tensor) -> list[int]:
    ours = _ours()
    rows = [i for i in range(len(CASES)) if _same_row(ours[i], theirs[i])]
    assert len(rows) >= len(CASES) - 3
    return rows


@pytest.mark.slow
def test_the_server_reports_vllms_logprob_of_each_token_it_draws(vllm_gpu) -> None:
    theirs = vllm_gpu[1]["small"]
    rows = _exact_rows(theirs)
    draws = 16
    index = torch.tensor(rows).repeat_interleave(draws)
    specs = [SampleSpec(SAMPLINGS[i], 0) for i in index.tolist()]
    tokens, reported, _ = sample_rows(LOGITS[index], specs, [None] * len(specs))
    expected = theirs[index, torch.tensor(tokens)]
    assert bool(torch.isfinite(expected).all()), "a token drawn outside vLLM's kept set"
    torch.testing.assert_close(torch.tensor(reported), expected, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_the_learner_scores_the_last_tie_vllm_keeps(vllm_gpu) -> None:
    """The target is each row's kept token with the smallest logit and, among a tie, the
    highest index: the one whose logprob the tie rule decides."""
    theirs = vllm_gpu[1]["small"]
    rows = _exact_rows(theirs)
    targets = []
    for i in rows:
        kept = torch.nonzero(torch.isfinite(theirs[i])).flatten()
        low = LOGITS[i, kept].min()
        targets.append(int(kept[LOGITS[i, kept] == low].max()))
    head = torch.nn.Linear(VOCAB, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(VOCAB))  # logits = hidden, exactly
    sampling = merged([(SAMPLINGS, np.array(rows))])
    logp, _, _ = chunked_logprobs(LOGITS[rows], head, torch.tensor(targets), sampling, 8)
    # 1e-4: at temperature 0.01 the logits are ~600, whose float32 spacing is 6e-5
    torch.testing.assert_close(logp.detach(), theirs[rows, targets], rtol=0, atol=1e-4)
