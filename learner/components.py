"""The learner's optional parts built from its config: reference, critic, dynamic sampling.

Each function reads `LearnerConfig` and returns one part, or None where the config
switches it off, so `learner.core` and `learner.service` wire parts together without knowing the
knobs of each: the reference model is loaded only when ``kl_coef > 0``, the
critic only for ``--algorithm ppo``, dynamic sampling only when asked.
"""

from __future__ import annotations

import torch

from learner.batch import filter_reason
from learner.config import Algorithm, LearnerConfig
from learner.critic import Critic, CriticConfig, load_critic
from learner.distributed import DistContext
from learner.reference import AdapterOffReference, Reference, load_reference
from learner.sampling import DynamicSampling


def dynamic_sampling(cfg: LearnerConfig) -> DynamicSampling | None:
    """Fill each batch with groups that train (DAPO), when asked."""
    rules = cfg.batch
    if not rules.dynamic_sampling:
        return None
    return DynamicSampling(
        lambda g: filter_reason(g, rules),
        cfg.groups_per_batch,
        rules.dynamic_sampling_max_factor,
        cfg.admission_steps,
    )


def reference_for(
    cfg: LearnerConfig, device: torch.device, policy: torch.nn.Module, dist: DistContext
) -> Reference | AdapterOffReference | None:
    """The frozen initial weights (``--model``, even on resume), only for a KL term; a LoRA
    run in one process scores with the `policy`'s adapters off instead of a second copy."""
    if not cfg.loss.kl_coef:
        return None
    if cfg.lora.enabled and not dist.enabled:
        return AdapterOffReference(policy)
    return load_reference(cfg.model, device, cfg.loss.reference_offload)


def critic_for(cfg: LearnerConfig, device: torch.device, dist: DistContext) -> Critic | None:
    """The value model of ``--algorithm ppo``."""
    if cfg.batch.algorithm is not Algorithm.PPO:
        return None
    loss = cfg.loss
    critic_cfg = CriticConfig(
        learning_rate=loss.critic_learning_rate,
        value_clip=loss.value_clip,
        gamma=cfg.batch.gamma,
        lam=loss.gae_lambda,
    )
    return load_critic(cfg.model, critic_cfg, cfg.optim, device, dist)
