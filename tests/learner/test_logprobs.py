"""Chunked logprobs under the sampled distribution: equal to the full-logits computation (values
and gradients), renormalised over the kept tokens, the target always kept, and the outside mass
equal to what the unrestricted distribution puts outside."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from broker.messages import Sampling
from learner.distribution import TokenSampling, merged
from learner.logprobs import VOCAB_TILE, chunked_logprobs, full_logprobs

TOKENS, HIDDEN, VOCAB = 23, 16, 97
ALLOWED = np.arange(0, VOCAB, 4)


def _sampling(table: list[Sampling], rows: list[int]) -> TokenSampling:
    return merged([(table, np.array(rows, np.int32))])


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).double()
    h = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.from_numpy(np.random.default_rng(seed).choice(ALLOWED, TOKENS))
    weights = torch.randn(TOKENS, generator=gen, dtype=torch.float64)
    return head, h, targets, weights


DISTRIBUTIONS = {
    "greedy": [Sampling(0.0)],
    "tempered": [Sampling(0.6), Sampling(1.3)],
    "allowed": [Sampling(1.0, allowed_token_ids=ALLOWED), Sampling(0.8)],
    "truncated": [Sampling(1.0, top_p=0.7), Sampling(0.9, top_k=5), Sampling(1.2, min_p=0.2)],
    "everything": [Sampling(0.7, top_k=9, top_p=0.8, min_p=0.05, allowed_token_ids=ALLOWED)],
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_chunked_equals_full_with_gradients(name: str) -> None:
    head, h, targets, weights = _case()
    table = DISTRIBUTIONS[name]
    sampling = _sampling(table, [k % (len(table) + 1) - 1 for k in range(TOKENS)])  # -1: plain

    def run(fn):  # both outputs take part in the loss, so both gradients are checked
        logp, ent = fn()[:2]
        (weights * logp + 0.3 * ent).sum().backward()
        grads = (h.grad.clone(), head.weight.grad.clone())
        h.grad, head.weight.grad = None, None
        return logp.detach(), ent.detach(), grads

    full = run(lambda: full_logprobs(h @ head.weight.T, targets, sampling))
    assert torch.isfinite(full[0]).all() and torch.isfinite(full[1]).all()
    # vocabulary tiles: one tile (VOCAB_TILE > V), uneven tiles, tiles of one column
    for chunk, tile in itertools.product((1, 5, 23, 64), (VOCAB_TILE, 10, 1)):
        got = run(lambda: chunked_logprobs(h, head, targets, sampling, chunk, vocab_tile=tile))  # noqa: B023
        torch.testing.assert_close(got[0], full[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], full[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[2], full[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tempered", "allowed", "truncated"])
def test_a_head_with_a_bias_gets_its_gradient(name: str) -> None:
    head, h, targets, weights = _case(3)
    head.bias = torch.nn.Parameter(torch.randn(VOCAB, dtype=torch.float64))
    table = DISTRIBUTIONS[name]
    sampling = _sampling(table, [k % len(table) for k in range(TOKENS)])
    grads = []
    for fn in (
        lambda: full_logprobs(head(h), targets, sampling),
        lambda: chunked_logprobs(h, head, targets, sampling, 4, vocab_tile=10),
    ):
        logp, ent = fn()[:2]
        (weights * logp + 0.3 * ent).sum().backward()
        grads.append((h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()))
        h.grad, head.weight.grad, head.bias.grad = None, None, None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _kept_by_hand(z: torch.Tensor, s: Sampling) -> list[int]:
    """vLLM's GPU rule, one token at a time: min-p, then exactly k in (value desc, index asc)
    order, then that order's shortest run whose mass reaches p."""
    order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
    floor = float(z.max()) + math.log(s.min_p) if s.min_p else -math.inf
    order = [i for i in order if float(z[i]) >= floor][: s.top_k or len(order)]
    probs = torch.softmax(z[order], dim=-1).tolist()
    mass, kept = 0.0, []
    for i, p in zip(order, probs, strict=True):
        if mass >= s.top_p:
            break
        kept.append(i)
        mass += p
    return kept


def test_tied_logits_keep_vllms_gpu_set_in_both_paths() -> None:
    """Integer weights and inputs make exact ties (as bf16 logits have): the learner keeps
    exactly k, and only the boundary ties top-p needs, lowest indices first; the target is the
    highest-index kept token, whose logprob the tie count decides. Gradients: chunked = full."""
    gen = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(torch.randint(-1, 2, (VOCAB, HIDDEN), generator=gen))
    h = torch.randint(-1, 2, (TOKENS, HIDDEN), generator=gen).double().requires_grad_()
    table = [Sampling(1.0, top_k=5), Sampling(0.5, top_p=0.6), Sampling(2.0, top_k=9, top_p=0.8)]
    table.append(Sampling(1.0, top_k=7, min_p=0.1))
    rows = [k % len(table) for k in range(TOKENS)]
    z = (h @ head.weight.T).detach()
    kept = [_kept_by_hand(z[t] / table[r].temperature, table[r]) for t, r in enumerate(rows)]
    assert sum(len(k) for k in kept) < sum(  # the ties bite: keeping them all is a bigger set
        int((z[t] >= z[t, k].min()).sum()) for t, k in enumerate(kept)
    )
    targets = torch.tensor([max(k) for k in kept])
    want = [
        float(
            z[t, targets[t]] / table[r].temperature
            - torch.logsumexp(z[t, k] / table[r].temperature, 0)
        )
        for t, (r, k) in enumerate(zip(rows, kept, strict=True))
    ]
    sampling = _sampling(table, rows)
    grads = []
    for fn in (
        lambda: full_logprobs(h @ head.weight.T, targets, sampling),
        lambda: chunked_logprobs(h, head, targets, sampling, 5, vocab_tile=10),
    ):
        logp, ent = fn()[:2]
        torch.testing.assert_close(logp.detach(), torch.tensor(want).float(), rtol=0, atol=1e-5)
        (logp + 0.3 * ent).sum().backward()
        grads.append((h.grad.clone(), head.weight.grad.clone()))
        h.grad, head.weight.grad = None, None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_renormalised_over_the_allowed_set_with_mass_outside_reported() -> None:
    head, h, targets, _ = _case(1)
    sampling = _sampling([Sampling(0.5, allowed_token_ids=ALLOWED)], [0] * TOKENS)
    logp, entropy, outside = chunked_logprobs(h, head, targets, sampling, 7)
    z = (h @ head.weight.T).detach() / 0.5
    inside = torch.log_softmax(z[:, ALLOWED], dim=-1)
    column = {int(t): k for k, t in enumerate(ALLOWED)}
    want = inside[torch.arange(TOKENS), [column[int(t)] for t in targets]]
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(logp.detach(), want.float(), **close)
    torch.testing.assert_close(entropy.detach(), -(inside.exp() * inside).sum(-1).float(), **close)
    kept = torch.softmax(z, dim=-1)[:, ALLOWED].sum(-1)
    torch.testing.assert_close(outside, (1 - kept).float(), **close)
    assert not outside.requires_grad
    # with nothing restricted there is no outside
    _, _, none = chunked_logprobs(h, head, targets, _sampling([Sampling(0.5)], [0] * TOKENS), 7)
    assert bool((none == 0).all())


def test_a_target_the_learner_would_truncate_is_kept_not_minus_infinity() -> None:
    """The sampler drew it, so it was in the sampler's kept set: a recomputed threshold that
    drops it (the policy moved, or float noise at the boundary) must not score it at -inf."""
    head, h, _, _ = _case(2)
    logits = (h @ head.weight.T).detach()
    worst = logits.argmin(dim=-1)  # far outside any top-2
    sampling = _sampling([Sampling(1.0, top_k=2)], [0] * TOKENS)
    logp, _, _ = chunked_logprobs(h, head, worst, sampling, 8)
    top2 = logits.topk(2, dim=-1).values
    kept = torch.cat([top2, logits.gather(1, worst[:, None])], dim=-1)
    want = logits.gather(1, worst[:, None])[:, 0] - torch.logsumexp(kept, dim=-1)
    torch.testing.assert_close(logp.detach(), want.float(), rtol=1e-5, atol=1e-5)


def test_no_vocabulary_sized_block_beyond_the_chunk_is_kept_for_backward() -> None:
    """What autograd saves grows with the hidden states, not with tokens x vocabulary."""
    tokens, hidden, vocab, chunk = 256, 8, 5000, 16
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    truncating = _sampling(
        [Sampling(0.9, top_p=0.8, allowed_token_ids=np.arange(0, vocab, 2))], [0] * tokens
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _, _ = chunked_logprobs(
            h, head, torch.zeros(tokens, dtype=torch.long), truncating, chunk
        )
    assert max(saved) < chunk * vocab  # never [T, V] (1.28M), not even one [chunk, V] block
    logp.sum().backward()
    assert h.grad is not None and float(h.grad.abs().sum()) > 0
