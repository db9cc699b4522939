"""The frozen reference policy for the KL term: the run's initial weights.

Loaded only when ``kl_coef > 0`` (`load_reference`), from ``--model`` even when
the learner resumes, so the KL is always to the weights the run started from.
It never trains (no gradient, eval mode). With ``reference_offload`` it lives in
CPU memory and visits the training device only for its forward pass, as verl's
reference offload does; on a CPU learner the flag changes nothing.

As a reward penalty (``kl_mode reward``), `kl_turn_penalties` estimates the KL
per token between the behaviour logprobs mu recorded at rollout and the
reference (no extra policy forward), sums it over each turn's completion
tokens and scales it by ``kl_coef``; the batch subtracts it from the turn's
reward before computing advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from learner.batch import Sample, TurnPenalties
from learner.config import KLEstimator
from learner.lora import adapters_off
from learner.losses import kl_penalty
from learner.scoring import Scoring, sequence_logprobs


class Reference:
    """A frozen model that scores sequences."""

    def __init__(self, model: torch.nn.Module, device: torch.device, offload: bool) -> None:
        self.device = device
        self.offload = offload and device.type != "cpu"
        self.model = model.to("cpu" if self.offload else device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def logprobs(self, samples: Sequence[Sample], scoring: Scoring) -> list[np.ndarray]:
        """Reference logprobs of every token of `samples` (input coordinates)."""
        if not self.offload:
            return sequence_logprobs(self.model, samples, scoring)
        self.model.to(scoring.device)
        try:
            return sequence_logprobs(self.model, samples, scoring)
        finally:
            self.model.to("cpu")


def load_reference(model_dir: Path, device: torch.device, offload: bool) -> Reference:
    """The initial weights of `model_dir`, frozen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return Reference(model, device, offload)


def kl_turn_penalties(
    reference: Reference,
    samples: Sequence[Sample],
    scoring: Scoring,
    estimator: KLEstimator,
    coef: float,
) -> TurnPenalties:
    """``coef * sum_{t in turn} KL_t(mu || ref)`` for every turn of every sample."""
    out: dict[tuple[str, int], np.ndarray] = {}
    if not samples:
        return out
    for sample, ref in zip(samples, reference.logprobs(samples, scoring), strict=True):
        assert sample.turn_index is not None and sample.turn_rewards is not None
        kl = kl_penalty(torch.from_numpy(sample.behaviour_logp), torch.from_numpy(ref), estimator)
        kl = kl.numpy() * sample.loss_mask
        turns = len(sample.turn_rewards)
        on = sample.turn_index >= 0
        sums = np.bincount(sample.turn_index[on], weights=kl[on], minlength=turns)
        key = (sample.group_id, sample.episode)  # an agent episode's segments add up
        out[key] = out.get(key, 0.0) + coef * sums
    return out


class AdapterOffReference:
    """The KL reference of a LoRA run: the policy's own base, adapters switched off.

    The run's initial weights are the base (peft starts B at zero), so no second copy of the
    model is loaded. One process only: under FSDP the policy's layers are sharded and
    scored through the root, so the sharded run loads the copy (`learner.reference`)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        self.model = lm

    def logprobs(self, samples: Sequence[Sample], scoring: Scoring) -> list[np.ndarray]:
        with adapters_off(self.model):
            return sequence_logprobs(self.model, samples, scoring)
