"""The contract between sampler and learner: the CPU policy server's reported logprob of a
sampled token equals the learner's recomputation under the distribution the turn records.

A real `python -m inference` server samples under several distributions (greedy; a
temperature with an allowed-token set; top-p; top-k with min-p at a high temperature); the
worker-side record (`Turn`, with its `Sampling`) goes through `prepare_batch` and the
learner's own forward (chunked LM head, packed row) recomputes every completion token's
logprob. vLLM's side of the same contract: tests/inference/vllm_contract/test_vllm_sampler.py.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from broker.messages import Sampling, Trajectory, TrajectoryGroup, Turn
from learner.batch import prepare_batch
from learner.config import ScaleConfig
from learner.distributed import DistContext
from tests.learner.factories import make_group
from tests.learner.farm import farm
from tests.learner.split import RULES, make_trainer

SAMPLINGS = (
    Sampling(0.0),
    Sampling(0.5, allowed_token_ids=np.arange(40, 120)),
    Sampling(1.0, top_p=0.8),
    Sampling(1.8, top_k=20, min_p=0.05),
)


def sample(url: str, prompt: list[int], sampling: Sampling) -> Turn:
    allowed = sampling.allowed_token_ids
    body = {
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "allowed_token_ids": None if allowed is None else allowed.tolist(),
        "logprobs": 1,
        "return_token_ids": True,
        "ignore_eos": True,
        "seed": 7,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return Turn(
        prompt,
        choice["token_ids"],
        choice["logprobs"]["token_logprobs"],
        0,
        0.0,
        True,
        False,
        sampling=sampling,
    )


def test_server_logprobs_equal_learner_recomputation(tiny_model_dir: Path, tmp_path: Path) -> None:
    with farm(tmp_path) as f:
        url = f.server("server", tiny_model_dir)
        turns = [
            sample(url, list(range(40 + 3 * i, 50 + 3 * i)), s) for i, s in enumerate(SAMPLINGS)
        ]
    template = make_group("contract", [0.0, 1.0, 0.0, 1.0])
    trajectories = tuple(
        Trajectory((t,), "terminated", sample_index=i) for i, t in enumerate(turns)
    )
    group = TrajectoryGroup("contract", template.task, trajectories, "w")
    samples = prepare_batch([group], replace(RULES, skip_zero_variance=False), version=0).samples
    trainer = make_trainer(tiny_model_dir, DistContext(), ScaleConfig(logprob_chunk_tokens=5))
    with torch.no_grad():
        batch, logp, _, _ = trainer.forward(samples)
        plain = [replace(s, samplings=(Sampling(),)) for s in samples]  # the raw model
        _, logp_raw, _, _ = trainer.forward(plain)
    mask = batch["mask"].bool()
    assert int(mask.sum()) == 12 * len(SAMPLINGS)
    error = (logp - batch["behaviour_logp"]).abs() * mask
    assert float(error.max()) < 1e-4, error.max(dim=1).values
    # the distribution matters: scored under the raw model instead, only greedy would match
    error_raw = ((logp_raw - batch["behaviour_logp"]).abs() * mask).max(dim=1).values
    assert [bool(e > 1e-2) for e in error_raw] == [False, True, True, True]
