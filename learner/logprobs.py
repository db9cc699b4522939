"""Token logprobs and entropies from final hidden states, in chunks, at the sampling temperature.

`chunked_logprobs(hidden, head, targets, temperature, chunk_tokens)` applies the LM head to
``chunk_tokens`` positions at a time, divides the logits by each token's sampling
temperature, and returns the target token's logprob and the entropy of that tempered
distribution. Each chunk runs under activation checkpointing: autograd keeps only the
chunk's hidden states and recomputes its logits in backward, so a ``[chunk, V]`` block is
the largest vocabulary-sized tensor alive at any time and ``[T, V]`` never exists for a
whole sequence. `full_logprobs` is the unchunked reference the tests and the memory
benchmark compare against.

Temperature convention (shared with the inference side, see docs/learner.md): a token
sampled at temperature ``t > 0`` is scored under ``softmax(logits / t)``; ``t == 0``
(greedy) is scored at 1, the model's raw distribution.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The divisor of the logits: the sampling temperature, or 1 for greedy (0)."""
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    logits = logits / effective_temperature(temperature).unsqueeze(-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    target = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(dim=-1)
    return target, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy), both float32 and shaped like ``targets``.

    ``hidden`` is ``[..., H]`` (the positions that predict ``targets``), ``targets`` and
    ``temperature`` are ``[...]``. Differentiable in ``hidden`` and the head's parameters.
    """
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t, flat_temp = targets.reshape(-1), temperature.reshape(-1).float()
    logps, ents = [], []
    for start in range(0, flat_t.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        args = (flat_h[start:stop], head.weight, head.bias, flat_t[start:stop],
                flat_temp[start:stop])  # fmt: skip
        if torch.is_grad_enabled():
            logp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            logp, ent = _chunk(*args)
        logps.append(logp)
        ents.append(ent)
    if not logps:
        empty = flat_h.new_zeros(0, dtype=torch.float32)
        return empty.reshape(shape), empty.reshape(shape)
    return torch.cat(logps).reshape(shape), torch.cat(ents).reshape(shape)


def full_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the same quantities from materialised ``[..., V]`` logits."""
    scaled = logits.float() / effective_temperature(temperature.float()).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    target = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return target, -(logprobs.exp() * logprobs).sum(dim=-1)
