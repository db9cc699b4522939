"""One optimizer step on a prepared batch: micro-batches, accumulation, clipping, AdamW.

`Trainer.step` splits this rank's sequences into micro-batches, runs forward and
backward on each with the loss share of `learner.algorithms.aggregate` (whose
denominators are those of the whole batch, all ranks included), sums gradients
across ranks when running distributed, clips the global norm and steps AdamW.
The device and precision choice lives behind one seam, `autocast_context`:
bf16 autocast on CUDA, plain fp32 on CPU. Dropout is kept off (eval mode) so
that the recomputed logprobs are those the served model would give.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from learner.algorithms import aggregate, policy_token_loss, token_entropy
from learner.batch import Sample
from learner.config import OptimConfig
from learner.distributed import DistContext


@dataclass(frozen=True)
class StepStats:
    """What one step measured (already reduced across ranks)."""

    loss: float
    tokens: int
    sequences: int
    clip_fraction: float
    entropy: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    grad_norm: float
    compute_s: float


def autocast_context(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA when asked; CPU always runs fp32."""
    if bf16 and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def collate(
    samples: Sequence[Sample], pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch into [B, T] tensors."""
    length = max(len(s.input_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.float32)
    logp = torch.zeros((b, length), dtype=torch.float32)
    adv = torch.zeros((b, length), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.from_numpy(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.from_numpy(s.loss_mask)
        logp[i, :n] = torch.from_numpy(s.behaviour_logp)
        adv[i, :n] = torch.from_numpy(s.advantages)
    stale = torch.tensor([s.stale for s in samples], dtype=torch.bool)
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "mask": mask,
        "behaviour_logp": logp,
        "advantages": adv,
        "stale": stale,
    }
    return {k: v.to(device) for k, v in tensors.items()}


def token_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, and the entropy there; both [B, T-1].

    Position t of the outputs scores token t+1 of the input.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = token_entropy(logits)
    return logp, entropy


def micro_batches(samples: Sequence[Sample], size: int) -> Iterator[Sequence[Sample]]:
    for start in range(0, len(samples), size):
        yield samples[start : start + size]


class Trainer:
    """Holds the model and its optimizer; `step` trains one batch."""

    def __init__(
        self, model: torch.nn.Module, cfg: OptimConfig, device: torch.device, dist: DistContext
    ) -> None:
        self.model = model.to(device)
        self.model.eval()
        self.cfg = cfg
        self.device = device
        self.dist = dist
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def step(self, local: Sequence[Sample], total_tokens: int, total_sequences: int) -> StepStats:
        """Train this rank's `local` share of a batch of `total_*` tokens and sequences."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        sums = torch.zeros(6, dtype=torch.float64)  # loss, clipped, entropy, ratio, ratio_min, -max
        sums[4], sums[5] = float("inf"), float("inf")
        for chunk in micro_batches(local, self.cfg.micro_batch_size):
            batch = collate(chunk, self.pad_id, self.device)
            with autocast_context(self.device, self.cfg.bf16(self.device.type)):
                logp, entropy = token_logprobs(self.model, batch)
            mask = batch["mask"][:, 1:]
            out = policy_token_loss(
                logp,
                batch["behaviour_logp"][:, 1:],
                batch["advantages"][:, 1:],
                clip_low=self.cfg.clip_low,
                clip_high=self.cfg.clip_high,
                stale=batch["stale"],
                tis_cap=self.cfg.tis_cap,
            )
            share = aggregate(
                out.loss,
                mask,
                self.cfg.aggregation,
                total_tokens=total_tokens,
                total_sequences=total_sequences,
            )
            share.backward()
            on = mask > 0
            sums[0] += float(share.detach())
            sums[1] += float(out.clipped[on].sum())
            sums[2] += float(entropy[on].sum())
            sums[3] += float(out.ratio[on].sum())
            if bool(on.any()):
                sums[4] = min(float(sums[4]), float(out.ratio[on].min()))
                sums[5] = min(float(sums[5]), -float(out.ratio[on].max()))
        self.dist.all_reduce_grads(self.model)
        sums = self.dist.reduce_stats(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        tokens = max(total_tokens, 1)
        return StepStats(
            loss=float(sums[0]),
            tokens=total_tokens,
            sequences=total_sequences,
            clip_fraction=float(sums[1]) / tokens,
            entropy=float(sums[2]) / tokens,
            ratio_mean=float(sums[3]) / tokens,
            ratio_min=float(sums[4]) if total_tokens else 1.0,
            ratio_max=-float(sums[5]) if total_tokens else 1.0,
            grad_norm=float(grad_norm),
            compute_s=time.perf_counter() - started,
        )
