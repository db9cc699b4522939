"""Optimizer steps on a prepared batch: epochs, mini-batches, token-budget micro-batches, AdamW.

`Trainer.update` trains one batch: it splits the batch into `mini_batches` mini-batches,
recomputes the proximal logprobs (when more than one optimizer step uses the batch) and
the reference logprobs (KL loss) before the first update, and takes one `Trainer.step` per
mini-batch and epoch. `Trainer.step` takes a whole mini-batch on every rank, plans its
micro-batches (`learner.microbatch`: length buckets under a token budget, packed rows where
enabled) and runs this rank's share, forward and backward, with the loss share of
`learner.losses.aggregate` (whose denominators are those of the whole mini-batch, all ranks
included). Logprobs come from `learner.policy.PolicyModel` (chunked LM head, under the
distribution each token was sampled from: allowed tokens, temperature, truncation). Under torchrun the policy is sharded with FSDP2
(`learner.sharding`), which sums gradients across ranks in backward; every rank runs the
same number of micro-batches (empty ones are zero-loss fillers) because each forward and
backward is collective. Then global-norm clipping and AdamW, unless the (all-reduced)
gradient is exactly zero: that mini-batch takes no optimizer step (`zero_gradient_steps`),
so Adam's momentum, weight decay and second-moment decay never act without a gradient
(docs/learner.md, "A batch with no gradient"). One process without torchrun
trains the plain module. On CUDA without FSDP the forward runs under bf16 autocast
(`autocast_context`); with FSDP, mixed precision is FSDP's policy. Dropout stays off (eval
mode) so that the recomputed logprobs are those the served model would give.

Sequences scored by a model that is not the trained policy (the frozen reference, the
critic) go through `learner.scoring`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learner import microbatch
from learner.batch import Sample
from learner.config import Aggregation, LossConfig, OptimConfig, ScaleConfig, loss_aggregation
from learner.distributed import DistContext
from learner.losses import (
    PolicyLossConfig,
    PolicyTerms,
    aggregate,
    decoupled_ppo_loss,
    kl_penalty,
)
from learner.microbatch import assign_ranks, plan_micro_batches
from learner.policy import PolicyModel, enable_activation_checkpointing, per_sequence
from learner.reference import Reference
from learner.scoring import Scoring, autocast_context
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
    dual_clip_fraction: float = 0.0  # tokens whose dual clip was active
    correction_fraction: float = 0.0  # tokens whose pi_prox/mu was capped (TIS) or masked (MIS)
    kl: float = 0.0  # mean per-token KL estimate to the reference
    optimizer_steps: int = 1  # optimizer steps taken
    zero_gradient_steps: int = 0  # optimizer steps not taken: the gradient was exactly zero
    behaviour_ratio_mean: float = 1.0  # pi_prox/mu before the cap: inference vs learner
    behaviour_ratio_max: float = 1.0
    behaviour_ratio_min: float = 1.0
    behaviour_log_ratio_std: float = 0.0  # spread of log(pi_prox/mu) over the tokens
    # policy mass outside each token's sampled support (the allowed set and truncation):
    # the sampler never shows it, so a drift there is visible only here
    outside_mass: float = 0.0
    rejected_fraction: float = 0.0  # tokens MIS left out of the loss and its denominator
    learning_rate: float = 0.0  # of this batch's optimizer steps
    kl_coef: float = 0.0  # of this batch's KL term
    value_loss: float | None = None  # the critic's clipped value loss (ppo)


def _filler(pad_id: int) -> Sample:
    """A zero-loss micro-batch for a rank with fewer real ones (collectives need every rank)."""
    zeros = np.zeros(2, np.float32)
    return Sample(
        np.full(2, pad_id, np.int64), zeros, zeros, zeros, np.full(2, -1, np.int32), False, ""
    )


def split(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """`parts` contiguous mini-batches of near-equal size (empty ones left out)."""
    bounds = np.linspace(0, len(samples), min(parts, max(len(samples), 1)) + 1).astype(int)
    return [list(samples[a:b]) for a, b in itertools.pairwise(bounds) if b > a]


class Trainer:
    """Holds the policy and its optimizer; `update` trains one batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        device: torch.device,
        dist: DistContext,
        *,
        scale: ScaleConfig | None = None,
        loss: LossConfig | None = None,
        reference: Reference | None = None,
    ) -> None:
        self.model = model.to(device)  # the Hugging Face LM; its state dict names the weights
        self.model.eval()
        scale = scale or ScaleConfig()
        self.cfg, self.scale, self.device, self.dist = cfg, scale, device, dist
        self.loss = loss or LossConfig()
        self.policy_loss = PolicyLossConfig.of(cfg, self.loss)
        self.aggregation = loss_aggregation(cfg, self.loss)
        self.policy = PolicyModel(self.model, scale.logprob_chunk_tokens)
        if scale.activation_checkpointing:
            enable_activation_checkpointing(self.policy)
        if dist.enabled:
            bf16 = cfg.bf16(device.type)
            mesh = dist.device_mesh(device.type)
            shard_policy(self.policy, mesh, ShardOptions(bf16, scale.cpu_offload))
        self.reference = reference  # frozen initial weights; only when the KL is a loss term
        # fused: one kernel per parameter, no parameter-sized temporaries (the per-tensor
        # loop's sqrt and division made two, 594 MiB for a 152k x 512 embedding)
        # only what trains: LoRA's frozen base gets neither gradients nor AdamW state
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=True,
        )
        self.kl_coef = self.loss.kl_coef  # moved by the adaptive KL controller (learner.core)
        pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.scoring = Scoring(cfg.micro_batch_size, cfg.bf16(device.type), self.pad_id, device)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision the policy's forward runs in (bf16 autocast on CUDA by default)."""
        if self.dist.enabled:  # FSDP's mixed-precision policy does the casting
            return contextlib.nullcontext()
        return autocast_context(self.device, self.cfg.bf16(self.device.type))

    def my_micro_batches(self, samples: Sequence[Sample]) -> list[list[Sample]]:
        """This rank's micro-batches of the whole batch `samples` (same count on every rank)."""
        lengths = [len(s.input_ids) for s in samples]
        plan = plan_micro_batches(
            lengths,
            self.scale.max_tokens_per_micro_batch,
            self.cfg.micro_batch_size,
            self.scale.packing,
        )
        mine = assign_ranks(plan, lengths, self.dist.world, self.scale.packing)[self.dist.rank]
        return [[samples[i] for i in mb] or [_filler(self.pad_id)] for mb in mine]

    def forward(
        self, samples: Sequence[Sample]
    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(collated batch, logprobs, entropy, outside mass), each [B, T-1], of one micro-batch."""
        batch = microbatch.collate(samples, self.pad_id, self.device, packed=self.scale.packing)
        with self.autocast():
            logp, entropy, outside = self.policy(batch)
        scattered = (per_sequence(x, batch) for x in (logp, entropy, outside))
        return batch, *scattered

    def prepare(self, samples: Sequence[Sample]) -> list[tuple[list[Sample], int, int]]:
        """(mini-batch, tokens, sequences) of each mini-batch, with the proximal and reference
        logprobs of this rank's micro-batches attached before the first update."""
        terms = self.loss
        kl_loss = self.reference is not None and terms.kl_loss
        shares = []
        for mini in split(samples, terms.mini_batches):
            if terms.needs_proximal or kl_loss:
                mini = self._annotate(mini, terms.needs_proximal, kl_loss)
            tokens = int(sum(s.loss_mask.sum() for s in mini))
            shares.append((mini, tokens, len(mini)))
        return shares

    def _annotate(self, mini: list[Sample], proximal: bool, kl_loss: bool) -> list[Sample]:
        """`mini` with this rank's samples carrying `prox_logp` and/or `ref_logp` (input
        coordinates); the micro-batch plan depends on lengths only, so `step` meets the
        same samples on this rank."""
        out = list(mini)
        where = {id(s): i for i, s in enumerate(mini)}
        for chunk in self.my_micro_batches(mini):
            real = [s for s in chunk if id(s) in where]
            extra: list[dict[str, np.ndarray]] = [{} for _ in real]
            if proximal:  # collective under FSDP: every rank runs every chunk, fillers too
                with torch.no_grad():
                    _, logp, _, _ = self.forward(chunk)
                rows = logp.float().cpu().numpy()
                for k, s in enumerate(real):
                    row = np.zeros(len(s.input_ids), np.float32)
                    row[1:] = rows[k, : len(s.input_ids) - 1]
                    extra[k]["prox_logp"] = row
            if kl_loss and real:
                assert self.reference is not None
                for k, ref in enumerate(self.reference.logprobs(real, self.scoring)):
                    extra[k]["ref_logp"] = ref
            for s, fields in zip(real, extra, strict=True):
                out[where[id(s)]] = dataclasses.replace(s, **fields)
        return out

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the optimizer steps that follow (`learner.schedule`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(self, samples: Sequence[Sample]) -> StepStats:
        """`ppo_epochs` passes over the batch, one optimizer step per mini-batch."""
        shares = self.prepare(samples)
        stats = [
            self.step(mini, tokens, sequences)
            for _ in range(self.loss.ppo_epochs)
            for mini, tokens, sequences in shares
        ]
        lr = float(self.optimizer.param_groups[0]["lr"])
        return dataclasses.replace(merge_stats(stats), learning_rate=lr, kl_coef=self.kl_coef)

    def _token_loss(
        self, batch: dict[str, Any], logp: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, PolicyTerms, torch.Tensor | None]:
        """Per-token loss of one micro-batch ([B, T-1]): policy, KL and entropy terms."""
        terms = self.loss
        prox = batch["prox_logp"] if "prox_logp" in batch else logp.detach()
        policy = decoupled_ppo_loss(
            logp,
            prox,
            batch["behaviour_logp"],
            batch["advantages"],
            batch["mask"],
            cfg=self.policy_loss,
        )
        loss = policy.loss
        kl = None
        if "ref_logp" in batch:
            kl = kl_penalty(logp, batch["ref_logp"], terms.kl_estimator)
            loss = loss + self.kl_coef * kl
        if terms.entropy_coef > 0:
            loss = loss - terms.entropy_coef * entropy
        return loss, policy, kl

    def step(self, samples: Sequence[Sample], total_tokens: int, total_sequences: int) -> StepStats:
        """Train this rank's share of the mini-batch `samples` (`total_*`: its whole counts)."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        tally = _Tally(self.device)
        for chunk in self.my_micro_batches(samples):
            batch, logp, entropy, outside = self.forward(chunk)
            token_loss, out, kl = self._token_loss(batch, logp, entropy)
            kept = batch["mask"] * (~out.rejected)  # MIS-rejected tokens leave the loss
            share = aggregate(
                token_loss,
                kept,
                self.aggregation,
                total_tokens=total_tokens,
                total_sequences=total_sequences,
                norm_tokens=self.cfg.norm_tokens,
            )
            share.backward()
            tally.add(batch["mask"] > 0, share, out, entropy, kl=kl, outside=outside)
        sums, mins = self.dist.reduce_sums(tally.sums), self.dist.reduce_mins(tally.mins)
        # ... and its denominator: the shares divided by every token (sequence); rescale to
        # the kept ones now that all ranks' rejections are counted
        scale = tally.rejection_scale(sums, self.aggregation, total_tokens, total_sequences)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if scale != 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(scale)
        grad_norm = clip_grad_norm(params, self.cfg.max_grad_norm)
        # No gradient, no step: AdamW would still move the weights by its momentum (and by
        # the weight decay) and decay its second moment, inflating the next real step. The
        # norm is all-reduced (FSDP), so every rank sees the same value and skips together.
        took = grad_norm != 0.0
        if took:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return tally.stats(
            sums,
            mins,
            total_tokens,
            total_sequences,
            grad_norm=float(grad_norm),
            compute_s=time.perf_counter() - started,
            scale=scale,
            took=took,
        )


class _Tally:
    """One step's token statistics on this rank: sums, and minimums (maxima stored negated)."""

    SUMS = (
        "loss",
        "clipped",
        "entropy",
        "ratio",
        "dual_clipped",
        "corrected",
        "kl",
        "behaviour_ratio",
        "log_behaviour",
        "log_behaviour_sq",
        "outside",
        "rejected",
        "rejected_sequences",
    )
    MINS = ("ratio_min", "-ratio_max", "behaviour_min", "-behaviour_max")

    def __init__(self, device: torch.device) -> None:
        # on the training device: one host sync per step (the reduction), not per micro-batch
        self.sums = torch.zeros(len(self.SUMS), dtype=torch.float64, device=device)
        self.mins = torch.full((len(self.MINS),), float("inf"), dtype=torch.float64, device=device)

    def add(
        self,
        on: torch.Tensor,
        share: torch.Tensor,
        out: PolicyTerms,
        entropy: torch.Tensor,
        *,
        kl: torch.Tensor | None,
        outside: torch.Tensor,
    ) -> None:
        """Add one micro-batch (`on`: its loss tokens)."""
        behaviour = out.behaviour_ratio[on]
        log_b = torch.log(behaviour.clamp(min=1e-30))
        values = (
            share.detach().sum(),
            out.clipped[on].sum(),
            entropy.detach()[on].sum(),
            out.ratio[on].sum(),
            out.dual_clipped[on].sum(),
            out.corrected[on].sum(),
            kl.detach()[on].sum() if kl is not None else torch.zeros((), device=on.device),
            behaviour.sum(),
            log_b.sum(),
            log_b.square().sum(),
            outside[on].sum(),
            (out.rejected & on).sum(),
            _fully(out.rejected, on).sum(),
        )
        self.sums += torch.stack([v.double() for v in values])
        if bool(on.any()):
            ratio = out.ratio[on]
            found = torch.stack([ratio.min(), -ratio.max(), behaviour.min(), -behaviour.max()])
            self.mins = torch.minimum(self.mins, found.double())

    def rejection_scale(
        self, sums: torch.Tensor, mode: Aggregation, tokens: int, sequences: int
    ) -> float:
        """What turns shares over every token (or sequence) into shares over the kept ones."""
        s = dict(zip(self.SUMS, sums.tolist(), strict=True))
        total, rejected = (
            (tokens, s["rejected"])
            if mode is Aggregation.TOKEN_MEAN
            else (sequences, s["rejected_sequences"])
        )
        if not rejected:
            return 1.0
        return total / (total - rejected) if rejected < total else 0.0

    def stats(
        self,
        sums: torch.Tensor,
        mins: torch.Tensor,
        tokens: int,
        sequences: int,
        *,
        grad_norm: float,
        compute_s: float,
        scale: float,
        took: bool,
    ) -> StepStats:
        """The step's statistics from the rank-reduced sums and minimums."""
        s = dict(zip(self.SUMS, sums.tolist(), strict=True))
        m = dict(zip(self.MINS, mins.tolist(), strict=True))
        n = max(tokens, 1)
        log_mean = s["log_behaviour"] / n
        log_var = max(s["log_behaviour_sq"] / n - log_mean**2, 0.0)
        some = tokens > 0
        return StepStats(
            loss=s["loss"] * scale,
            tokens=tokens,
            sequences=sequences,
            clip_fraction=s["clipped"] / n,
            entropy=s["entropy"] / n,
            ratio_mean=s["ratio"] / n,
            ratio_min=m["ratio_min"] if some else 1.0,
            ratio_max=-m["-ratio_max"] if some else 1.0,
            grad_norm=grad_norm,
            compute_s=compute_s,
            dual_clip_fraction=s["dual_clipped"] / n,
            correction_fraction=s["corrected"] / n,
            kl=s["kl"] / n,
            behaviour_ratio_mean=s["behaviour_ratio"] / n if some else 1.0,
            behaviour_ratio_max=-m["-behaviour_max"] if some else 1.0,
            behaviour_ratio_min=m["behaviour_min"] if some else 1.0,
            behaviour_log_ratio_std=log_var**0.5,
            outside_mass=s["outside"] / n,
            rejected_fraction=s["rejected"] / n,
            optimizer_steps=int(took),
            zero_gradient_steps=int(not took),
        )


def _fully(rejected: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Per row: every loss token of the sequence was rejected (and it has some)."""
    count = on.sum(dim=-1)
    return ((rejected & on).sum(dim=-1) == count) & (count > 0)


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
        behaviour_ratio_min=min(s.behaviour_ratio_min for s in stats),
        behaviour_log_ratio_std=mean("behaviour_log_ratio_std"),
        outside_mass=mean("outside_mass"),
        rejected_fraction=mean("rejected_fraction"),
        optimizer_steps=sum(s.optimizer_steps for s in stats),
        zero_gradient_steps=sum(s.zero_gradient_steps for s in stats),
    )
