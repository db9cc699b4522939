"""Optimizer steps on a prepared batch: epochs, mini-batches, micro-batches, AdamW.

`Trainer.update` trains one batch: it splits the batch into `mini_batches`
mini-batches, recomputes the proximal logprobs (when more than one optimizer
step uses the batch) and the reference logprobs (KL loss) before the first
update, and takes one `Trainer.step` per mini-batch and epoch. `Trainer.step`
splits this rank's share of a mini-batch into micro-batches, runs forward and
backward on each with the loss share of `learner.losses.aggregate` (whose
denominators are those of the whole mini-batch, all ranks included), sums
gradients across ranks when running distributed, clips the global norm and
steps AdamW.
The device and precision choice lives behind one seam, `autocast_context`:
bf16 autocast on CUDA, plain fp32 on CPU. Dropout is kept off (eval mode) so
that the recomputed logprobs are those the served model would give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from learner.algorithms import token_entropy
from learner.batch import Sample
from learner.config import LossConfig, OptimConfig
from learner.distributed import DistContext
from learner.losses import (
    PolicyLossConfig,
    PolicyTerms,
    aggregate,
    decoupled_ppo_loss,
    kl_penalty,
)

if TYPE_CHECKING:
    from learner.reference import Reference


@dataclass(frozen=True)
class Scoring:
    """How sequences are scored without gradient: micro-batches, precision, padding, device."""

    micro_batch_size: int
    bf16: bool
    pad_id: int
    device: torch.device


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
    dual_clip_fraction: float = 0.0  # tokens whose dual clip was active
    correction_fraction: float = 0.0  # tokens whose pi_prox/mu was capped (TIS) or masked (MIS)
    kl: float = 0.0  # mean per-token KL estimate to the reference
    optimizer_steps: int = 1
    behaviour_ratio_mean: float = 1.0  # pi_prox/mu before the cap: inference vs learner
    behaviour_ratio_max: float = 1.0
    value_loss: float | None = None  # the critic's clipped value loss (ppo)


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
    tensors = {"input_ids": ids, "attention_mask": attn, "mask": mask, "behaviour_logp": logp,
               "advantages": adv}  # fmt: skip
    for name in ("prox_logp", "ref_logp"):  # set on every sample of a batch, or on none
        if getattr(samples[0], name) is not None:
            tensors[name] = torch.zeros((b, length), dtype=torch.float32)
            for i, s in enumerate(samples):
                tensors[name][i, : len(s.input_ids)] = torch.from_numpy(getattr(s, name))
    return {k: v.to(device) for k, v in tensors.items()}


def token_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, and the entropy there; both [B, T-1].

    Position t of the outputs scores token t+1 of the input. The entropy carries a
    gradient only when asked (`entropy_coef` > 0).
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        entropy = token_entropy(logits)
    return logp, entropy


def sequence_logprobs(
    model: torch.nn.Module, samples: Sequence[Sample], scoring: Scoring
) -> list[np.ndarray]:
    """Each sample's token logprobs under `model`, no gradient, in input coordinates.

    Entry t scores token t (entry 0, which nothing predicts, is 0), like `behaviour_logp`.
    """
    out: list[np.ndarray] = []
    with torch.no_grad():
        for chunk in micro_batches(samples, scoring.micro_batch_size):
            with autocast_context(scoring.device, scoring.bf16):
                logp, _ = token_logprobs(model, collate(chunk, scoring.pad_id, scoring.device))
            logp = logp.float().cpu().numpy()
            for i, s in enumerate(chunk):
                row = np.zeros(len(s.input_ids), np.float32)
                row[1:] = logp[i, : len(s.input_ids) - 1]
                out.append(row)
    return out


def split(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """`parts` contiguous mini-batches of near-equal size (empty ones left out)."""
    bounds = np.linspace(0, len(samples), min(parts, max(len(samples), 1)) + 1).astype(int)
    return [list(samples[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


def micro_batches(samples: Sequence[Sample], size: int) -> Iterator[Sequence[Sample]]:
    for start in range(0, len(samples), size):
        yield samples[start : start + size]


class Trainer:
    """Holds the model and its optimizer; `update` trains one batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        device: torch.device,
        dist: DistContext,
        loss: LossConfig | None = None,
        reference: Reference | None = None,
    ) -> None:
        self.model = model.to(device)
        self.model.eval()
        self.cfg = cfg
        self.loss = loss or LossConfig()
        self.policy = PolicyLossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                       dual_clip=self.loss.dual_clip,
                                       correction=self.loss.correction, cap=cfg.tis_cap,
                                       log_ratio_clamp=self.loss.log_ratio_clamp)  # fmt: skip
        self.bf16 = cfg.bf16(device.type)
        self.device = device
        self.dist = dist
        self.reference = reference  # frozen initial weights; only when the KL is a loss term
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay
        )
        config = getattr(model, "config", None)
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.scoring = Scoring(cfg.micro_batch_size, self.bf16, self.pad_id, device)

    def prepare(self, samples: Sequence[Sample]) -> list[tuple[list[Sample], int, int]]:
        """(this rank's share, tokens, sequences) of each mini-batch, logprobs attached.

        Proximal and reference logprobs are computed here, before the first update.
        """
        terms = self.loss
        shares = []
        for mini in split(samples, terms.mini_batches):
            local = self.dist.shard(mini)
            if local and terms.needs_proximal:
                prox = sequence_logprobs(self.model, local, self.scoring)
                local = [
                    dataclasses.replace(s, prox_logp=p) for s, p in zip(local, prox, strict=True)
                ]
            if local and self.reference is not None and terms.kl_loss:
                ref = self.reference.logprobs(local, self.scoring)
                local = [
                    dataclasses.replace(s, ref_logp=r) for s, r in zip(local, ref, strict=True)
                ]
            tokens = int(sum(s.loss_mask.sum() for s in mini))
            shares.append((local, tokens, len(mini)))
        return shares

    def update(self, samples: Sequence[Sample]) -> StepStats:
        """`ppo_epochs` passes over the batch, one optimizer step per mini-batch."""
        shares = self.prepare(samples)
        stats = [
            self.step(local, tokens, sequences)
            for _ in range(self.loss.ppo_epochs)
            for local, tokens, sequences in shares
        ]
        return merge_stats(stats)

    def _token_loss(
        self, batch: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, PolicyTerms, torch.Tensor | None]:
        """Per-token loss of one micro-batch: policy, KL and entropy terms."""
        terms = self.loss
        prox = batch["prox_logp"][:, 1:] if "prox_logp" in batch else logp.detach()
        policy = decoupled_ppo_loss(logp, prox, batch["behaviour_logp"][:, 1:],
                                    batch["advantages"][:, 1:], self.policy)  # fmt: skip
        loss = policy.loss
        kl = None
        if "ref_logp" in batch:
            kl = kl_penalty(logp, batch["ref_logp"][:, 1:], terms.kl_estimator)
            loss = loss + terms.kl_coef * kl
        if terms.entropy_coef > 0:
            loss = loss - terms.entropy_coef * entropy
        return loss, policy, kl

    def step(self, local: Sequence[Sample], total_tokens: int, total_sequences: int) -> StepStats:
        """Train this rank's `local` share of a batch of `total_*` tokens and sequences."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        sums = torch.zeros(6, dtype=torch.float64)  # loss, clipped, entropy, ratio, ratio_min, -max
        sums[4], sums[5] = float("inf"), float("inf")
        # dual-clipped, corrected, kl, sum and -max of pi_prox/mu
        extra = torch.zeros(5, dtype=torch.float64)
        extra[4] = float("inf")
        for chunk in micro_batches(local, self.cfg.micro_batch_size):
            batch = collate(chunk, self.pad_id, self.device)
            with autocast_context(self.device, self.bf16):
                logp, entropy = token_logprobs(self.model, batch, self.loss.entropy_coef > 0)
            mask = batch["mask"][:, 1:]
            token_loss, out, kl = self._token_loss(batch, logp, entropy)
            share = aggregate(token_loss, mask, self.cfg.aggregation,
                              total_tokens=total_tokens, total_sequences=total_sequences)  # fmt: skip
            share.backward()
            on = mask > 0
            sums[0] += float(share.detach())
            sums[1] += float(out.clipped[on].sum())
            sums[2] += float(entropy.detach()[on].sum())
            sums[3] += float(out.ratio[on].sum())
            extra[0] += float(out.dual_clipped[on].sum())
            extra[1] += float(out.corrected[on].sum())
            extra[2] += float(kl.detach()[on].sum()) if kl is not None else 0.0
            extra[3] += float(out.behaviour_ratio[on].sum())
            if bool(on.any()):
                sums[4] = min(float(sums[4]), float(out.ratio[on].min()))
                sums[5] = min(float(sums[5]), -float(out.ratio[on].max()))
                extra[4] = min(float(extra[4]), -float(out.behaviour_ratio[on].max()))
        self.dist.all_reduce_grads(self.model)
        sums = self.dist.reduce_stats(sums)
        extra = self.dist.reduce_stats(extra)
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
            dual_clip_fraction=float(extra[0]) / tokens,
            correction_fraction=float(extra[1]) / tokens,
            kl=float(extra[2]) / tokens,
            behaviour_ratio_mean=float(extra[3]) / tokens if total_tokens else 1.0,
            behaviour_ratio_max=-float(extra[4]) if total_tokens else 1.0,
        )


def merge_stats(stats: Sequence[StepStats]) -> StepStats:
    """One record for several optimizer steps on one batch: means, extremes, total time."""
    if len(stats) == 1:
        return stats[0]
    mean = lambda name: float(np.mean([getattr(s, name) for s in stats]))  # noqa: E731
    return StepStats(
        loss=mean("loss"),
        tokens=sum(s.tokens for s in stats) // max(len(stats), 1),
        sequences=sum(s.sequences for s in stats) // max(len(stats), 1),
        clip_fraction=mean("clip_fraction"),
        entropy=mean("entropy"),
        ratio_mean=mean("ratio_mean"),
        ratio_min=min(s.ratio_min for s in stats),
        ratio_max=max(s.ratio_max for s in stats),
        grad_norm=mean("grad_norm"),
        compute_s=sum(s.compute_s for s in stats),
        dual_clip_fraction=mean("dual_clip_fraction"),
        correction_fraction=mean("correction_fraction"),
        kl=mean("kl"),
        behaviour_ratio_mean=mean("behaviour_ratio_mean"),
        behaviour_ratio_max=max(s.behaviour_ratio_max for s in stats),
        optimizer_steps=len(stats),
    )
