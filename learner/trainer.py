"""One optimizer step on a prepared batch: token-budget micro-batches, accumulation, AdamW.

`Trainer.step` takes the whole batch on every rank, plans its micro-batches
(`learner.microbatch`: length buckets under a token budget, packed rows where enabled) and
runs this rank's share, forward and backward, with the loss share of
`learner.algorithms.aggregate` (whose denominators are those of the whole batch, all ranks
included). Logprobs come from `learner.policy.PolicyModel` (chunked LM head, divided by each
token's sampling temperature). Under torchrun the policy is sharded with FSDP2
(`learner.sharding`), which sums gradients across ranks in backward; every rank runs the
same number of micro-batches (empty ones are zero-loss fillers) because each forward and
backward is collective. Then global-norm clipping and AdamW. One process without torchrun
trains the plain module. On CUDA without FSDP the forward runs under bf16 autocast
(`autocast_context`); with FSDP, mixed precision is FSDP's policy. Dropout stays off (eval
mode) so that the recomputed logprobs are those the served model would give.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from learner.algorithms import aggregate, policy_token_loss
from learner.batch import Sample
from learner.config import OptimConfig, ScaleConfig
from learner.distributed import DistContext
from learner.microbatch import assign_ranks, collate, plan_micro_batches
from learner.policy import PolicyModel, enable_activation_checkpointing, per_sequence
from learner.sharding import ShardOptions, clip_grad_norm, shard_policy


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


def _filler(pad_id: int) -> Sample:
    """A zero-loss micro-batch for a rank with fewer real ones (collectives need every rank)."""
    zeros = np.zeros(2, np.float32)
    return Sample(np.full(2, pad_id, np.int64), zeros, zeros, zeros, np.ones(2, np.float32),
                  False, "")  # fmt: skip


class Trainer:
    """Holds the policy and its optimizer; `step` trains one batch."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, device: torch.device,
                 dist: DistContext, scale: ScaleConfig | None = None) -> None:  # fmt: skip
        self.model = model.to(device)  # the Hugging Face LM; its state dict names the weights
        self.model.eval()
        scale = scale or ScaleConfig()
        self.cfg, self.scale, self.device, self.dist = cfg, scale, device, dist
        self.policy = PolicyModel(self.model, scale.logprob_chunk_tokens)
        if scale.activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        if dist.enabled:
            bf16 = cfg.bf16(device.type)
            shard_policy(self.policy, device, ShardOptions(dist.world, bf16, scale.cpu_offload))
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dist.enabled:  # FSDP's mixed-precision policy does the casting
            return contextlib.nullcontext()
        return autocast_context(self.device, self.cfg.bf16(self.device.type))

    def my_micro_batches(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        """This rank's micro-batches of the whole batch `samples` (same count on every rank)."""
        lengths = [len(s.input_ids) for s in samples]
        plan = plan_micro_batches(lengths, self.scale.max_tokens_per_micro_batch,
                                  self.cfg.micro_batch_size, self.scale.packing)  # fmt: skip
        mine = assign_ranks(plan, lengths, self.dist.world, self.scale.packing)[self.dist.rank]
        return [[samples[i] for i in mb] or [_filler(self.pad_id)] for mb in mine]

    def forward(self, samples: Sequence[Sample]) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                          torch.Tensor]:  # fmt: skip
        """(collated batch, logprobs [B, T-1], entropy [B, T-1]) of one micro-batch."""
        batch = collate(samples, self.pad_id, self.device, packed=self.scale.packing)
        with self._autocast():
            logp, entropy = self.policy(batch)
        return batch, per_sequence(logp, batch), per_sequence(entropy, batch)

    def step(self, samples: Sequence[Sample], total_tokens: int, total_sequences: int) -> StepStats:
        """Train this rank's share of the batch `samples` (`total_*`: the whole batch's counts)."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(6, dtype=torch.float64)  # loss, clipped, entropy, ratio, ratio_min, -max
        sums[4], sums[5] = float("inf"), float("inf")
        for chunk in self.my_micro_batches(samples):
            batch, logp, entropy = self.forward(chunk)
            mask = batch["mask"]
            out = policy_token_loss(
                logp,
                batch["behaviour_logp"],
                batch["advantages"],
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
            sums[2] += float(entropy.detach()[on].sum())
            sums[3] += float(out.ratio[on].sum())
            if bool(on.any()):
                sums[4] = min(float(sums[4]), float(out.ratio[on].min()))
                sums[5] = min(float(sums[5]), -float(out.ratio[on].max()))
        sums = self.dist.reduce_stats(sums)
        grad_norm = clip_grad_norm(list(self.policy.parameters()), self.cfg.max_grad_norm)
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
            grad_norm=grad_norm,
            compute_s=time.perf_counter() - started,
        )
