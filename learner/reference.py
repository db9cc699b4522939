"""The frozen reference policy for the KL term: the run's initial weights.

Loaded only when ``kl_coef > 0`` (`load_reference`), from ``--model`` even when
the learner resumes, so the KL is always to the weights the run started from.
It never trains (no gradient, eval mode). With ``reference_offload`` it lives in
CPU memory and visits the training device only for its forward pass, as verl's
reference offload does; on a CPU learner the flag changes nothing.

As a reward penalty (``kl_mode reward``), `kl_token_penalties` estimates the KL
per token between the behaviour logprobs mu recorded at rollout and the
reference (no extra policy forward) and scales it by ``kl_coef``: each token's
reward is ``-kl_coef * KL_t``, so the return at token t counts the KL from t on
(`learner.batch.prepare_batch`; the critic's GAE puts it on every token).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from learner.batch import Sample, TokenPenalties
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


def kl_token_penalties(
    reference: Reference,
    samples: Sequence[Sample],
    scoring: Scoring,
    estimator: KLEstimator,
    coef: float,
) -> TokenPenalties:
    """``coef * KL_t(mu || ref)`` on every completion token of `samples`, per turn.

    A per-token reward, as verl's ``use_kl_in_reward`` and REINFORCE++ apply it: the return
    at token t counts only the KL from t on. An agent episode's segments fill in their own
    turns of the episode's entry."""
    out: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    if not samples:
        return out
    for sample, ref in zip(samples, reference.logprobs(samples, scoring), strict=True):
        assert sample.turn_index is not None
        kl = kl_penalty(torch.from_numpy(sample.behaviour_logp), torch.from_numpy(ref), estimator)
        kl = coef * kl.numpy().astype(np.float64) * sample.loss_mask
        turns = out.setdefault((sample.group_id, sample.episode), {})
        for k in np.unique(sample.turn_index[sample.turn_index >= 0]):
            turns[int(k)] = kl[sample.turn_index == k]
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
