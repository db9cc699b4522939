"""Token-budget micro-batches: which sequences run together, on which rank, in which layout.

`plan_micro_batches` sorts a batch's sequences by length (longest first) and fills
micro-batches greedily up to a token budget and a sequence cap. A micro-batch costs its
*packed* tokens (the sum of its lengths) when the model takes packed sequences, or its
*padded* tokens (longest x count) otherwise, so bucketing by length keeps padding small.
A sequence longer than the budget runs alone. `assign_ranks` deals the micro-batches to
ranks, heaviest first, and gives every rank the same count (padding with empty micro-batches)
because FSDP needs every rank in every forward and backward.

`collate` lays a micro-batch out for the model: right-padded rows with an attention mask,
or one packed row whose position ids restart at 0 for each sequence (transformers then
builds a block-diagonal causal mask, or varlen attention under flash-attention). Either
way the loss side gets the same ``[B, T-1]`` per-sequence tensors; ``src`` / ``dst`` map
the scored hidden positions of the model's output to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from learner.batch import Sample
from learner.distribution import merged


def _cost(lengths: list[int], packing: bool) -> int:
    return sum(lengths) if packing else max(lengths) * len(lengths)


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, max_sequences: int, packing: bool
) -> list[list[int]]:
    """Indices of each micro-batch; ``max_tokens`` 0 means no token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    for i in order:
        candidate = [*current, i]
        over = max_tokens and _cost([lengths[j] for j in candidate], packing) > max_tokens
        if current and (over or len(candidate) > max_sequences):
            plan.append(current)
            candidate = [i]
        current = candidate
    if current:
        plan.append(current)
    return plan


def assign_ranks(
    plan: list[list[int]], lengths: Sequence[int], world: int, packing: bool
) -> list[list[list[int]]]:
    """Each rank's micro-batches: least-loaded rank first, equal counts (``[]`` pads)."""
    load = [0] * world
    out: list[list[list[int]]] = [[] for _ in range(world)]
    per_rank = -(-len(plan) // world)
    heaviest = sorted(plan, key=lambda mb: -_cost([lengths[i] for i in mb], packing))
    for mb in heaviest:
        rank = min((r for r in range(world) if len(out[r]) < per_rank), key=lambda r: load[r])
        out[rank].append(mb)
        load[rank] += _cost([lengths[i] for i in mb], packing)
    for ranks in out:
        ranks += [[] for _ in range(per_rank - len(ranks))]
    return out


def _per_sequence(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    """[B, width] shifted loss-side tensors: position t scores token t + 1."""
    b = len(samples)
    mask, logp, adv = (torch.zeros((b, width), dtype=torch.float32) for _ in range(3))
    for i, s in enumerate(samples):
        n = len(s.input_ids) - 1
        mask[i, :n] = torch.from_numpy(s.loss_mask[1:])
        logp[i, :n] = torch.from_numpy(s.behaviour_logp[1:])
        adv[i, :n] = torch.from_numpy(s.advantages[1:])
    stale = torch.tensor([s.stale for s in samples], dtype=torch.bool)
    out = {"mask": mask, "behaviour_logp": logp, "advantages": adv, "stale": stale}
    for name in ("prox_logp", "ref_logp"):  # set by the trainer on every real sample, or none
        if all(getattr(s, name) is not None for s in samples):
            out[name] = torch.zeros((b, width), dtype=torch.float32)
            for i, s in enumerate(samples):
                out[name][i, : len(s.input_ids) - 1] = torch.from_numpy(getattr(s, name)[1:])
    return out


def collate(
    samples: Sequence[Sample], pad_id: int, device: torch.device, packed: bool = False
) -> dict[str, torch.Tensor]:
    """Model inputs, scored positions and loss-side tensors of one micro-batch."""
    lengths = [len(s.input_ids) for s in samples]
    width = max(lengths) - 1
    row_len = sum(lengths) if packed else max(lengths)
    rows = 1 if packed else len(samples)
    ids = torch.full((rows, row_len), pad_id, dtype=torch.long)
    pos = torch.zeros((rows, row_len), dtype=torch.long)
    attn = torch.zeros((rows, row_len), dtype=torch.long)
    src, dst = [], []
    offset = 0
    for i, (s, n) in enumerate(zip(samples, lengths, strict=True)):
        row, col = (0, offset) if packed else (i, 0)
        ids[row, col : col + n] = torch.from_numpy(s.input_ids)
        pos[row, col : col + n] = torch.arange(n)
        attn[row, col : col + n] = 1
        src.append(row * row_len + col + np.arange(n - 1))
        dst.append(i * width + np.arange(n - 1))
        offset += n
    flat_src = torch.from_numpy(np.concatenate(src))
    targets = ids.reshape(-1)[flat_src + 1]
    sampling = merged([(s.samplings, s.sampling_index[1:]) for s in samples])
    tensors = {
        "input_ids": ids,
        "position_ids": pos,
        "src": flat_src,
        "dst": torch.from_numpy(np.concatenate(dst)),
        "targets": targets,
        "sampling": sampling,  # each target's sampled distribution (a TokenSampling)
        **_per_sequence(samples, width),
    }
    if not packed:  # a packed row has no padding; its position ids delimit the sequences
        tensors["attention_mask"] = attn
    return {k: v.to(device) for k, v in tensors.items()}
