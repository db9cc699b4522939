"""The trained policy as one module: decoder forward, then chunked logprobs under each token's
sampled distribution.

`PolicyModel` wraps a Hugging Face causal LM (``lm``). Its ``forward`` runs the decoder
to the final hidden states, keeps only the positions that score a token (``src``) and
applies the LM head chunk by chunk (`learner.logprobs.chunked_logprobs`), so full
``[T, V]`` logits never exist. Making this the module FSDP treats as its root means the
root's parameters (embeddings, final norm, LM head) are gathered once around the whole
forward and backward, including every per-chunk use of the head.

`enable_activation_checkpointing` recomputes each decoder layer in backward (torch's
non-reentrant checkpoint around the layer's forward; FSDP's hooks stay outside it). The
state dict of `lm` keeps the Hugging Face parameter names: checkpoints and exports use it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from learner.logprobs import chunked_logprobs
from learner.tied import GradSink, tied_input_embeds


class PolicyModel(torch.nn.Module):
    """``forward(batch) -> (logprobs, entropy, outside mass)``, each ``[N]``, of the scored
    tokens of a micro-batch, under the distribution each was sampled from."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    @property
    def layers(self) -> list[torch.nn.Module]:
        """The decoder layers (the units FSDP shards and checkpointing recomputes)."""
        return list(self.lm.base_model.layers)  # type: ignore[union-attr, arg-type]

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        embed = self.lm.get_input_embeddings()  # type: ignore[operator]
        # a plain tied embedding adds its gradient into the head's (`learner.tied`); a
        # subclass (a scaled embedding, say) may do more than the lookup, so it runs as is;
        # a frozen one (LoRA) has no gradient to add
        tied = (
            type(embed) is torch.nn.Embedding
            and embed.weight is head.weight
            and head.weight.requires_grad
        )
        sink = GradSink() if tied else None
        inputs: dict[str, torch.Tensor] = (
            {"inputs_embeds": tied_input_embeds(self.lm, batch["input_ids"], sink)}
            if sink is not None
            else {"input_ids": batch["input_ids"]}
        )
        out = self.lm.base_model(  # type: ignore[operator]
            **inputs,
            attention_mask=batch.get("attention_mask"),
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        hidden = out.last_hidden_state
        scored = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["src"])
        return chunked_logprobs(
            scored, head, batch["targets"], batch["sampling"], self.chunk_tokens, sink=sink
        )


def enable_activation_checkpointing(policy: PolicyModel) -> None:
    """Recompute every decoder layer's activations in backward instead of keeping them."""
    for layer in policy.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)  # type: ignore[method-assign]


def per_sequence(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scatter the scored tokens' values [N] into the loss side's [B, T-1] layout."""
    b, width = batch["mask"].shape
    out = values.new_zeros(b * width)
    return out.index_copy(0, batch["dst"], values).reshape(b, width)
