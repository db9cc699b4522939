"""The learner's parts built from its config: batch rules, trainer config, reference, critic.

Each function reads `LearnerConfig` and returns one part (or None where the config
switches it off), so `learner.service` wires parts together without knowing the
knobs of each: the reference model is loaded only when ``kl_coef > 0``, the
critic only for ``--algorithm ppo``, dynamic sampling only when asked.
"""

from __future__ import annotations

import torch

from learner.batch import BatchRules, filter_reason
from learner.config import Algorithm, KLMode, LearnerConfig, Precision, StalePolicy
from learner.critic import Critic, CriticConfig, load_critic
from learner.distributed import DistContext
from learner.losses import PolicyLossConfig
from learner.reference import Reference, load_reference
from learner.sampling import DynamicSampling
from learner.trainer import LossTerms, OptimConfig


def batch_rules(cfg: LearnerConfig, replay: bool) -> BatchRules:
    """What a batch trains; a replay's versions are not this run's, so nothing is stale."""
    return BatchRules(
        algorithm=cfg.algorithm,
        gamma=cfg.gamma,
        max_staleness=None if replay else cfg.max_staleness,
        drop_stale=cfg.stale_policy is StalePolicy.DROP,
        skip_zero_variance=cfg.skip_zero_variance,
        scale_by_std=cfg.grpo_scale_by_std,
        group_std=cfg.grpo_std,
        overlong=cfg.overlong,
        overlong_max_tokens=cfg.overlong_max_tokens or 0,
        overlong_buffer=cfg.overlong_buffer,
        overlong_penalty=cfg.overlong_penalty,
    )


def optim_config(cfg: LearnerConfig, device: torch.device) -> OptimConfig:
    """The trainer's share of the config."""
    bf16 = cfg.precision is Precision.BF16 or (
        cfg.precision is Precision.AUTO and device.type == "cuda"
    )
    policy = PolicyLossConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              dual_clip=cfg.dual_clip, correction=cfg.correction, cap=cfg.tis_cap,
                              log_ratio_clamp=cfg.log_ratio_clamp)  # fmt: skip
    kl_loss = cfg.kl_coef if cfg.kl_mode is KLMode.LOSS else 0.0
    terms = LossTerms(ppo_epochs=cfg.ppo_epochs, mini_batches=cfg.mini_batches, kl_coef=kl_loss,
                      kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef)  # fmt: skip
    return OptimConfig(
        learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, micro_batch_size=cfg.micro_batch_size,
        aggregation=cfg.aggregation, bf16=bf16, policy=policy, terms=terms,
    )  # fmt: skip


def dynamic_sampling(cfg: LearnerConfig) -> DynamicSampling | None:
    """Fill each batch with groups that train (DAPO), unless switched off."""
    if not cfg.dynamic_sampling:
        return None
    rules = batch_rules(cfg, replay=False)
    return DynamicSampling(lambda g: filter_reason(g, rules), cfg.groups_per_batch,
                           cfg.dynamic_sampling_max_factor, cfg.admission_steps)  # fmt: skip


def reference_for(cfg: LearnerConfig, device: torch.device) -> Reference | None:
    """The frozen initial weights (``--model``, even on resume), only for a KL term."""
    if not cfg.kl_coef:
        return None
    return load_reference(cfg.model, device, cfg.reference_offload)


def critic_for(
    cfg: LearnerConfig, optim: OptimConfig, device: torch.device, dist: DistContext
) -> Critic | None:
    """The value model of ``--algorithm ppo``."""
    if cfg.algorithm is not Algorithm.PPO:
        return None
    critic_cfg = CriticConfig(learning_rate=cfg.critic_learning_rate, value_clip=cfg.value_clip,
                              gamma=cfg.gamma, lam=cfg.gae_lambda)  # fmt: skip
    return load_critic(cfg.model, critic_cfg, optim, device, dist)
