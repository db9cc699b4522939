"""Token logprobs and entropies from final hidden states, in chunks, at the sampling temperature.

`chunked_logprobs(hidden, head, targets, temperature, chunk_tokens)` applies the LM head to
``chunk_tokens`` positions at a time, divides the logits by each token's sampling
temperature, and returns the target token's logprob and the entropy of that tempered
distribution. Each chunk is one autograd node (`_ChunkLogprobs`) that keeps only the
chunk's hidden states and per-token scalars, recomputes the chunk's logits in backward and
forms their gradient in place: at most two ``[chunk, V]`` float32 buffers exist at any
time, and ``[T, V]`` never exists for a whole sequence. `full_logprobs` is the unchunked reference the tests and the memory
benchmark compare against.

Temperature convention (shared with the inference side, see docs/learner.md): a token
sampled at temperature ``t > 0`` is scored under ``softmax(logits / t)``; ``t == 0``
(greedy) is scored at 1, the model's raw distribution.
"""

from __future__ import annotations

import torch


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The divisor of the logits: the sampling temperature, or 1 for greedy (0)."""
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(temperature.unsqueeze(-1))


class _ChunkLogprobs(torch.autograd.Function):
    """Target logprob and entropy of one chunk; backward recomputes the chunk's logits.

    Saves only the chunk's hidden states and per-token scalars, and works on at most two
    ``[chunk, V]`` float32 buffers at a time (forward and backward). With ``z`` the tempered
    logits, ``p = softmax(z)`` and ``H`` the entropy: ``d logp_y / dz = onehot(y) - p`` and
    ``dH / dz = -p (log p + H)``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature):  # type: ignore[no-untyped-def]
        z = _scaled_logits(hidden, weight, bias, temperature)
        lse = torch.logsumexp(z, dim=-1)
        target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        probs = (z - lse.unsqueeze(-1)).exp_()
        entropy = lse - probs.mul_(z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, temperature, lse, entropy)
        return target, entropy

    @staticmethod
    def backward(ctx, grad_target, grad_entropy):  # type: ignore[no-untyped-def]
        hidden, weight, bias, targets, temperature, lse, entropy = ctx.saved_tensors
        with torch.no_grad():
            logp = _scaled_logits(hidden, weight, bias, temperature).sub_(lse.unsqueeze(-1))
            probs = logp.exp()
            # dL/dz = g_H * (-p (logp + H)) + g_y * (onehot(y) - p), built in place in `logp`
            grad = logp.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
            grad.sub_(probs.mul_(grad_target.unsqueeze(-1)))
            del probs
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_target.unsqueeze(-1))
            grad = grad.div_(temperature.unsqueeze(-1)).to(weight.dtype)
            grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
            grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
            grad_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None


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
        temps = effective_temperature(flat_temp[start:stop])
        logp, ent = _ChunkLogprobs.apply(flat_h[start:stop], head.weight, head.bias,
                                         flat_t[start:stop], temps)  # fmt: skip
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
