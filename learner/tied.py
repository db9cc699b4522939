"""A tied input embedding whose gradient is added into the LM head's, not beside it.

With tied embeddings (the embedding matrix is the LM head's weight) autograd would keep the
head's ``[V, H]`` weight gradient until the embedding's backward, at the very end, made a
second dense ``[V, H]`` (zeros plus the looked-up rows) to add to it: 297 MiB more at the end
of every backward for a 152k x 512 embedding. Here the head (`learner.logprobs`) leaves its
weight gradient in a `GradSink` as it returns it, and `TiedEmbedding`'s backward adds its
rows into that same tensor in place and returns no weight gradient of its own. Autograd runs
the head's node before the embedding's (the embedding's output feeds everything) and
accumulates the weight's gradient only after both, so the tensor it accumulates already holds
both parts. Where the head left nothing (it did not need a weight gradient), the embedding
returns its dense gradient as usual.
"""

from __future__ import annotations

import torch


class GradSink:
    """The head's weight gradient of one backward, handed to the embedding's backward."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        """The gradient, dropping this reference (so autograd may reuse the tensor as .grad)."""
        grad, self.grad = self.grad, None
        return grad


class TiedEmbedding(torch.autograd.Function):
    """``embedding(ids, weight)``, the weight's gradient added into the sink's tensor."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, sink):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(ids)
        ctx.weight_like, ctx.padding_idx, ctx.sink = weight.new_empty(0), padding_idx, sink
        ctx.shape = weight.shape
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives its padding row no gradient
            rows = rows * (flat != ctx.padding_idx).unsqueeze(-1)
        grad = ctx.sink.take()
        if not ctx.needs_input_grad[1]:  # a frozen embedding: no [V, H] zeros to build
            return None, None, None, None
        if grad is not None:
            grad.index_add_(0, flat, rows.to(grad.dtype))
            return None, None, None, None
        dense = ctx.weight_like.new_zeros(ctx.shape)
        return None, dense.index_add_(0, flat, rows.to(dense.dtype)), None, None


def tied_input_embeds(lm: torch.nn.Module, ids: torch.Tensor, sink: GradSink) -> torch.Tensor:
    """The input embeddings of ``ids``, through `TiedEmbedding` over the LM's embedding."""
    embed = lm.get_input_embeddings()  # type: ignore[operator]
    return TiedEmbedding.apply(ids, embed.weight, embed.padding_idx, sink)
