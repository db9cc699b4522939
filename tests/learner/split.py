"""A fixed batch and trainer shared by the single-process and the torchrun FSDP tests.

Sequences of three lengths (8, 16, 24 tokens) sampled from three distributions (each with its
own temperature, and top-p; an allowed-token set; top-k with min-p), trained with a token
budget, packing and small logprob chunks, so that micro-batching, packing, chunking and the
sampled distribution all take part in what the tests compare.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from broker.messages import Sampling
from learner.batch import BatchRules, Sample, prepare_batch
from learner.config import Aggregation, Algorithm, OptimConfig, ScaleConfig
from learner.distributed import DistContext
from learner.trainer import Trainer
from tests.learner.factories import make_group

RULES = BatchRules(Algorithm.GRPO, 1.0, max_staleness=4, skip_zero_variance=True)
SAMPLINGS = (
    Sampling(0.7, top_p=0.9),
    Sampling(1.0, allowed_token_ids=np.arange(0, 256, 3)),
    Sampling(1.5, top_k=50, min_p=0.01),
)
SCALE = ScaleConfig(max_tokens_per_micro_batch=40, packing=True, logprob_chunk_tokens=7)


def batch_samples(name: str) -> list[Sample]:
    groups = [
        make_group(
            f"{name}-{i}", [0.0, 1.0, 2.0, 0.5], turns=1 + i, vocab=256, sampling=SAMPLINGS[i]
        )
        for i in range(3)
    ]
    return prepare_batch(groups, RULES, version=0).samples


def make_trainer(model_dir: Path, dist: DistContext, scale: ScaleConfig = SCALE) -> Trainer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = OptimConfig(
        learning_rate=1e-3,
        weight_decay=0.01,
        clip_low=0.2,
        clip_high=0.2,
        tis_cap=2.0,
        max_grad_norm=1.0,
        micro_batch_size=64,
        aggregation=Aggregation.TOKEN_MEAN,
    )
    return Trainer(model, cfg, torch.device("cpu"), dist, scale=scale)
