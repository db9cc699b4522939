"""Token logprobs and entropies from final hidden states, in chunks, under the sampled distribution.

`chunked_logprobs(hidden, head, targets, sampling, chunk_tokens)` applies the LM head to
``chunk_tokens`` positions at a time and scores each target under the distribution the sampler
drew it from (`learner.distribution.TokenSampling`, applied by `inference.sampling`: the
allowed-token mask, the temperature, min-p, top-k and top-p, renormalised over the kept
tokens, with vLLM's GPU tie rule: `inference.sampling.Cut`). It returns the target's logprob,
the entropy of that distribution, and the policy's probability mass outside it (under the
tempered, unrestricted distribution: a drift the sampler never shows). The whole head is one
autograd node (`_HeadLogprobs`) that keeps only the hidden states and per-token scalars (the
truncation is kept as a cut, a value and a tie index per token, so backward re-applies it
without sorting), recomputes each chunk's logits in backward and forms their
gradient in place: at most two ``[chunk, V]`` float32 buffers exist at any time, ``[T, V]``
never exists for a whole sequence, and the head's weight gradient is one ``[V, H]`` buffer
that every chunk adds into. `full_logprobs` is the unchunked reference the
tests and the memory benchmark compare against.

The kept set is treated as fixed in backward (no gradient flows through which tokens it
keeps), and the target is always in it: the sampler drew it, so a target that a cut
recomputed from the learner's own logits would drop (float noise at a boundary, a tie the cut
no longer reaches, or a policy that moved) is kept rather than scored at -inf.
"""

from __future__ import annotations

import torch

from inference.sampling import Cut, RowSampling, effective_temperature, keep_cut, tempered_logits
from learner.distribution import TokenSampling
from learner.tied import GradSink

_FLOOR = torch.finfo(torch.float32).min  # stands for -inf where 0 * -inf would give nan


def _tempered(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: RowSampling
) -> torch.Tensor:
    """The chunk's float32 logits over each row's temperature, unmasked (one new buffer)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(effective_temperature(rows.temperature).unsqueeze(-1))


def _keep(z: torch.Tensor, rows: RowSampling, targets: torch.Tensor, cut: Cut | None) -> Cut | None:
    """Set `z` (tempered) to -inf outside each row's kept set, in place, the target always kept;
    return the truncation's cut (computed here when `cut` is None and rows truncate)."""
    target = z.gather(-1, targets.unsqueeze(-1))
    if rows.allowed is not None:
        z.masked_fill_(~rows.allowed, float("-inf"))
    if cut is None and rows.truncates():
        cut = keep_cut(z, rows)
    if cut is not None:
        cut.apply_(z)
    z.scatter_(-1, targets.unsqueeze(-1), target)
    return cut


def _chunk_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: RowSampling,
) -> tuple[torch.Tensor, ...]:
    """(target logprob, entropy, outside mass, logsumexp, cut) of a chunk whose rows
    truncate (the cut needs whole rows: ``[chunk, V]`` logits)."""
    z = _tempered(hidden, weight, bias, rows)
    full = torch.logsumexp(z, dim=-1)
    cut = _keep(z, rows, targets, None)
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    # 1 - the kept mass under the tempered, unrestricted policy
    outside = -torch.expm1(lse - full)
    z.clamp_(min=_FLOOR)  # exp(_FLOOR - lse) is 0: p z is 0 outside, not nan
    probs = (z - lse.unsqueeze(-1)).exp_()
    entropy = lse - probs.mul_(z).sum(dim=-1)
    return target, entropy, outside, lse, cut


def _chunk_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: RowSampling,
    *,
    saved: tuple[torch.Tensor, torch.Tensor, Cut],
    grad_target: torch.Tensor,
    grad_entropy: torch.Tensor,
) -> torch.Tensor:
    """dL/dlogits of a truncating chunk, ``[chunk, V]`` in the weight's dtype, recomputed."""
    lse, entropy, cut = saved
    logp = _tempered(hidden, weight, bias, rows)
    _keep(logp, rows, targets, cut)
    logp.clamp_(min=_FLOOR).sub_(lse.unsqueeze(-1))
    probs = logp.exp()
    # dL/dz = g_H * (-p (logp + H)) + g_y * (onehot(y) - p), built in place in `logp`
    grad = logp.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
    grad.sub_(probs.mul_(grad_target.unsqueeze(-1)))
    del probs
    grad.scatter_add_(-1, targets.unsqueeze(-1), grad_target.unsqueeze(-1))
    scale = effective_temperature(rows.temperature).unsqueeze(-1)
    return grad.div_(scale).to(weight.dtype)


def _tile_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: torch.Tensor,
    cols: tuple[int, int],
) -> torch.Tensor:
    """Float32 logits of vocabulary columns ``cols`` over each row's temperature."""
    a, b = cols
    logits = torch.nn.functional.linear(hidden, weight[a:b], None if bias is None else bias[a:b])
    return logits.float().div_(temperature.unsqueeze(-1))


def _tile_keep(
    z: torch.Tensor, rows: RowSampling, targets: torch.Tensor, cols: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask a tile to the allowed set in place, its target kept; (target's column, in tile)."""
    a, b = cols
    inside = (targets >= a) & (targets < b)
    column = (targets - a).clamp_(0, b - a - 1).unsqueeze(-1)
    if rows.allowed is not None:
        target = z.gather(-1, column)
        z.masked_fill_(~rows.allowed[:, a:b], float("-inf"))
        z.scatter_(-1, column, torch.where(inside.unsqueeze(-1), target, z.gather(-1, column)))
    return column, inside


class _Online:
    """Running logsumexp of tiles of a row, and the sum of ``exp(z - m) z`` (for the entropy)."""

    def __init__(self, rows: int, like: torch.Tensor) -> None:
        self.m = like.new_full((rows,), float("-inf"), dtype=torch.float32)
        self.s = like.new_zeros(rows, dtype=torch.float32)
        self.t = like.new_zeros(rows, dtype=torch.float32)

    def add(self, z: torch.Tensor) -> None:
        """Fold in a tile ``z`` (clamped in place: -inf becomes a finite floor, e^z still 0)."""
        m = torch.maximum(self.m, z.amax(dim=-1))
        shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row all -inf so far
        rescale = torch.exp(self.m - shift)
        z.clamp_(min=_FLOOR)  # p z is 0 outside the kept set, not nan
        e = (z - shift.unsqueeze(-1)).exp_()
        self.s.mul_(rescale).add_(e.sum(dim=-1))
        self.t.mul_(rescale).add_(e.mul_(z).sum(dim=-1))
        self.m = m

    def lse(self) -> torch.Tensor:
        return self.m + self.s.log()

    def mean_z(self) -> torch.Tensor:
        """``sum p z`` under the softmax of everything added."""
        return self.t / self.s


def _tiled_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: RowSampling,
    *,
    tile: int,
) -> tuple[torch.Tensor, ...]:
    """`_chunk_forward` for rows that do not truncate, over vocabulary tiles (online softmax)."""
    n, vocab = targets.shape[0], weight.shape[0]
    temperature = effective_temperature(rows.temperature)
    kept, everything = _Online(n, hidden), _Online(n, hidden)
    target = hidden.new_zeros(n, dtype=torch.float32)
    for a in range(0, vocab, tile):
        cols = (a, min(a + tile, vocab))
        z = _tile_logits(hidden, weight, bias, temperature, cols)
        if rows.allowed is not None:
            everything.add(z)
        column, inside = _tile_keep(z, rows, targets, cols)
        target = torch.where(inside, z.gather(-1, column).squeeze(-1), target)
        kept.add(z)
        del z
    lse = kept.lse()
    # 1 - the kept mass under the tempered, unrestricted policy (0 when nothing is dropped)
    outside = -torch.expm1(lse - everything.lse()) if rows.allowed is not None else None
    return target - lse, lse - kept.mean_z(), outside, lse, None


def _tiled_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    rows: RowSampling,
    *,
    saved: tuple[torch.Tensor, torch.Tensor],
    grads: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    tile: int,
) -> None:
    """Add the chunk's gradients into ``out`` (hidden rows, weight, bias), tile by tile."""
    lse, entropy = saved
    grad_target, grad_entropy = grads
    grad_hidden, grad_weight, grad_bias = out
    vocab = weight.shape[0]
    temperature = effective_temperature(rows.temperature)
    for a in range(0, vocab, tile):
        b = min(a + tile, vocab)
        logp = _tile_logits(hidden, weight, bias, temperature, (a, b))
        column, inside = _tile_keep(logp, rows, targets, (a, b))
        logp.clamp_(min=_FLOOR).sub_(lse.unsqueeze(-1))
        probs = logp.exp()
        # dL/dz = g_H * (-p (logp + H)) + g_y * (onehot(y) - p), built in place in `logp`
        grad = logp.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
        grad.sub_(probs.mul_(grad_target.unsqueeze(-1)))
        del probs
        grad.scatter_add_(-1, column, (grad_target * inside).unsqueeze(-1))
        grad = grad.div_(temperature.unsqueeze(-1)).to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden.addmm_(grad, weight[a:b])
        if grad_weight is not None:
            grad_weight[a:b].addmm_(grad.t(), hidden)
        if grad_bias is not None:
            grad_bias[a:b].add_(grad.sum(0))


class _HeadLogprobs(torch.autograd.Function):
    """Target logprob, entropy and outside mass of every token, chunk by chunk; backward
    recomputes the logits.

    One autograd node for the whole head: it saves the hidden states (already alive: they are
    its input) and per-token scalars (the truncation as a cut per token). A chunk whose
    rows do not truncate (no top-k, top-p or min-p) is scored over vocabulary tiles with an
    online softmax, so its buffers are ``[chunk, tile]``; a chunk with a truncating row needs
    whole rows to find the cut and works on at most two ``[chunk, V]`` float buffers. In
    backward every chunk's weight gradient is added into one ``[V, H]`` buffer and its
    hidden-state gradient written into one ``[N, H]`` buffer (a node per chunk made autograd
    hold a second ``[V, H]`` gradient while summing them, and a zero-filled ``[N, H]`` per
    chunk for the slices). With ``z`` the kept logits, ``p = softmax(z)`` (0 outside the kept
    set) and ``H`` the entropy: ``d logp_y / dz = onehot(y) - p`` and
    ``dH / dz = -p (log p + H)``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sampling, chunk_tokens, tile, sink):  # type: ignore[no-untyped-def]  # noqa: PLR0917 -- Function.apply passes positionally
        n, vocab = targets.shape[0], weight.shape[0]
        spans = [(a, min(a + chunk_tokens, n)) for a in range(0, n, chunk_tokens)]
        target, entropy, lse = (hidden.new_empty(n, dtype=torch.float32) for _ in "tel")
        outside = hidden.new_zeros(n, dtype=torch.float32)
        cuts = []
        for a, b in spans:
            # the rows' allowed mask is [chunk, V]: rebuilt in backward from `sampling`, not kept
            rows = sampling.rows(a, b, vocab)
            args = (hidden[a:b], weight, bias, targets[a:b], rows)
            parts = _chunk_forward(*args) if rows.truncates() else _tiled_forward(*args, tile=tile)
            for out, part in zip((target, entropy, outside, lse), parts[:4], strict=True):
                if part is not None:
                    out[a:b] = part
            cuts.append(parts[4])
        ctx.sampling, ctx.spans, ctx.cuts, ctx.tile = sampling, spans, cuts, tile
        ctx.sink = sink
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.mark_non_differentiable(outside)
        return target, entropy, outside

    @staticmethod
    def backward(ctx, grad_target, grad_entropy, _grad_outside):  # type: ignore[no-untyped-def]
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if bias is not None and need_bias else None
        with torch.no_grad():
            for (a, b), cut in zip(ctx.spans, ctx.cuts, strict=True):
                rows = ctx.sampling.rows(a, b, weight.shape[0])
                h, y = hidden[a:b], targets[a:b]
                g = (grad_target[a:b], grad_entropy[a:b])
                rows_out = None if grad_hidden is None else grad_hidden[a:b]
                if cut is None:
                    _tiled_grad(
                        h,
                        weight,
                        bias,
                        y,
                        rows,
                        saved=(lse[a:b], entropy[a:b]),
                        grads=g,
                        out=(rows_out, grad_weight, grad_bias),
                        tile=ctx.tile,
                    )
                    continue
                saved = (lse[a:b], entropy[a:b], cut)
                grad = _chunk_grad(
                    h, weight, bias, y, rows, saved=saved, grad_target=g[0], grad_entropy=g[1]
                )
                if rows_out is not None:
                    rows_out.addmm_(grad, weight)
                if grad_weight is not None:
                    grad_weight.addmm_(grad.t(), h)
                if grad_bias is not None:
                    grad_bias.add_(grad.sum(0))
        if ctx.sink is not None:  # the tied embedding adds its rows in (`learner.tied`)
            ctx.sink.grad = grad_weight
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


VOCAB_TILE = 8192  # vocabulary columns per tile: [chunk, 8192] float32 buffers, not [chunk, V]


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    sampling: TokenSampling,
    chunk_tokens: int,
    *,
    vocab_tile: int = VOCAB_TILE,
    sink: GradSink | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy, outside mass), float32, shaped like ``targets``.

    ``hidden`` is ``[..., H]`` (the positions that predict ``targets``), ``targets`` is ``[...]``
    and ``sampling`` has one entry per target. Differentiable in ``hidden`` and the head's
    parameters (the outside mass is not). ``sink`` receives the head's weight gradient (a tied
    embedding adds into it: `learner.tied`).
    """
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    if not flat_t.shape[0]:
        empty = flat_h.new_zeros(0, dtype=torch.float32).reshape(shape)
        return empty, empty, empty
    parts = _HeadLogprobs.apply(
        flat_h, head.weight, head.bias, flat_t, sampling, chunk_tokens, vocab_tile, sink
    )
    logp, entropy, outside = (part.reshape(shape) for part in parts)
    return logp, entropy, outside


def full_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, sampling: TokenSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (logprob, entropy) from materialised ``[..., V]`` logits, differentiable
    through the kept logits (the target kept, as in the chunked path)."""
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    flat_t = targets.reshape(-1)
    rows = sampling.rows(0, len(flat_t), flat.shape[-1])
    z = tempered_logits(flat, rows)
    if rows.truncates():
        with torch.no_grad():
            drop = keep_cut(z.detach(), rows).dropped(z.detach())
        z = z.masked_fill(drop.scatter_(-1, flat_t.unsqueeze(-1), False), float("-inf"))
    logprobs = torch.log_softmax(z, dim=-1)
    target = logprobs.gather(-1, flat_t.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs.clamp(min=_FLOOR)).sum(dim=-1)
    return target.reshape(shape), entropy.reshape(shape)
