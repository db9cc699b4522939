"""Chunked, tempered logprobs: equal to the full-logits computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from learner.logprobs import chunked_logprobs, full_logprobs


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
def test_chunked_equals_full_with_gradients(temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 23, 16, 97
    head = torch.nn.Linear(hidden, vocab, bias=False).double()
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    temps = torch.full((tokens,), temperature, dtype=torch.float64)
    temps[::5] = 1.3  # a second temperature in the same batch (another turn)
    weights = torch.randn(tokens, generator=gen, dtype=torch.float64)

    def run(fn):  # both outputs take part in the loss, so both gradients are checked
        logp, ent = fn()
        (weights * logp + 0.3 * ent).sum().backward()
        grads = (h.grad.clone(), head.weight.grad.clone())
        h.grad, head.weight.grad = None, None
        return logp.detach(), ent.detach(), grads

    full = run(lambda: full_logprobs(h @ head.weight.T, targets, temps))
    for chunk in (1, 5, 23, 64):
        got = run(lambda chunk=chunk: chunked_logprobs(h, head, targets, temps, chunk))
        torch.testing.assert_close(got[0], full[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], full[1], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[2], full[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the temperature really changed the distribution (0 means greedy: scored at 1)
    plain = full_logprobs(h @ head.weight.T, targets, torch.ones_like(temps))[0].detach()
    assert not torch.allclose(full[0][::5], plain[::5])  # the tokens at 1.3
    assert torch.allclose(full[0][1:5], plain[1:5]) == (temperature in (0.0, 1.0))


def test_no_vocabulary_sized_block_beyond_the_chunk_is_kept_for_backward() -> None:
    """What autograd saves grows with the hidden states, not with tokens x vocabulary."""
    tokens, hidden, vocab, chunk = 256, 8, 5000, 16
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = chunked_logprobs(h, head, torch.zeros(tokens, dtype=torch.long),
                                   torch.ones(tokens), chunk)  # fmt: skip
    assert max(saved) < chunk * vocab  # never [T, V] (1.28M), not even one [chunk, V] block
    logp.sum().backward()
    assert h.grad is not None and float(h.grad.abs().sum()) > 0
