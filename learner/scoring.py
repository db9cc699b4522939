"""Scoring sequences without gradient, with a model that is not the trained policy.

The frozen reference (`learner.reference`, KL) and the critic (`learner.critic`, values)
score a batch's sequences here: plain micro-batches of `Scoring.micro_batch_size`, each
right-padded (`collate`), run under the run's precision (`autocast_context`), and every
score moved to input coordinates (entry t is about token t; entry 0 is 0), like
`behaviour_logp`. The trainer's own forward, sharded and token-budgeted, is
`learner.trainer`'s; this module holds what it shares with the reference and critic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learner.batch import Sample
from learner.distribution import merged
from learner.logprobs import full_logprobs


@dataclass(frozen=True)
class Scoring:
    """How sequences are scored without gradient: micro-batches, precision, padding, device."""

    micro_batch_size: int
    bf16: bool
    pad_id: int
    device: torch.device


def autocast_context(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when asked; CPU always runs fp32."""
    if bf16 and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batches(samples: Sequence[Sample], size: int) -> Iterator[Sequence[Sample]]:
    for start in range(0, len(samples), size):
        yield samples[start : start + size]


def collate(samples: Sequence[Sample], pad_id: int, device: torch.device) -> dict[str, Any]:
    """Right-pad a micro-batch into unshifted [B, T] tensors (for the reference and critic),
    with each target's sampled distribution (``sampling``, for the [B, T-1] positions)."""
    length = max(len(s.input_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    names = ("loss_mask", "behaviour_logp", "advantages")
    rows = {name: torch.zeros((b, length), dtype=torch.float32) for name in names}
    targets = []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.from_numpy(s.input_ids)
        attn[i, :n] = 1
        for name in names:
            rows[name][i, :n] = torch.from_numpy(getattr(s, name))
        padded = np.full(length - 1, -1, np.int32)
        padded[: n - 1] = s.sampling_index[1:]
        targets.append((s.samplings, padded))
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "mask": rows["loss_mask"],
        "behaviour_logp": rows["behaviour_logp"],
        "advantages": rows["advantages"],
        "sampling": merged(targets),
    }
    return {k: v.to(device) for k, v in tensors.items()}


def token_logprobs(
    model: torch.nn.Module, batch: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix under the distribution it was sampled from, and
    that distribution's entropy; both [B, T-1]. Position t scores token t+1 of the input."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return full_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], batch["sampling"])


def sequence_logprobs(
    model: torch.nn.Module, samples: Sequence[Sample], scoring: Scoring
) -> list[np.ndarray]:
    """Each sample's token logprobs under `model`, no gradient, in input coordinates.

    Entry t scores token t (entry 0, which nothing predicts, is 0), like `behaviour_logp`.
    """
    return score_tokens(samples, scoring, lambda batch: token_logprobs(model, batch)[0], np.float32)


def score_tokens(
    samples: Sequence[Sample],
    scoring: Scoring,
    score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    dtype: type[np.floating],
    *,
    tail: bool = False,
) -> list[np.ndarray]:
    """`score(batch)` ([B, T-1], position t about input token t+1) for each sample, no
    gradient, micro-batch by micro-batch, moved to input coordinates: entry t is about
    token t and entry 0, before which there is nothing, is 0. With `tail`, `score` gives
    [B, T] and each row has one entry more, about what follows the sample's last token."""
    out: list[np.ndarray] = []
    with torch.no_grad():
        for chunk in micro_batches(samples, scoring.micro_batch_size):
            with autocast_context(scoring.device, scoring.bf16):
                scores = score(collate(chunk, scoring.pad_id, scoring.device))
            scores_np = scores.float().cpu().numpy()
            for i, s in enumerate(chunk):
                n = len(s.input_ids) + tail
                row = np.zeros(n, dtype)
                row[1:] = scores_np[i, : n - 1]
                out.append(row)
    return out
