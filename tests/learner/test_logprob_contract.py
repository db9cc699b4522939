"""The contract between sampler and learner: the CPU policy server's reported logprob of a
sampled token equals the learner's recomputation at the temperature the turn records.

A real `python -m inference` server samples at several temperatures (top-p 1, no token
restriction: the setting the contract covers); the worker-side record (`Turn`, with the
temperature) goes through `prepare_batch` and the learner's own forward (chunked LM head,
packed row) recomputes every completion token's logprob.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from broker.messages import Trajectory, TrajectoryGroup, Turn
from learner.batch import prepare_batch
from learner.config import ScaleConfig
from learner.distributed import DistContext
from tests.learner.factories import make_group
from tests.learner.farm import farm
from tests.learner.split import RULES, make_trainer

TEMPERATURES = (0.0, 0.5, 1.0, 1.8)


def sample(url: str, prompt: list[int], temperature: float) -> Turn:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": temperature, "logprobs": 1,
            "return_token_ids": True, "ignore_eos": True, "seed": 7}  # fmt: skip
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return Turn(prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"], 0, 0.0, True,
                False, temperature=temperature)  # fmt: skip


def test_server_logprobs_equal_learner_recomputation(tiny_model_dir: Path, tmp_path: Path) -> None:
    with farm(tmp_path) as f:
        url = f.server("server", tiny_model_dir)
        turns = [sample(url, list(range(40 + 3 * i, 50 + 3 * i)), t)
                 for i, t in enumerate(TEMPERATURES)]  # fmt: skip
    template = make_group("contract", [0.0, 1.0, 0.0, 1.0])
    trajectories = tuple(
        Trajectory((t,), "terminated", sample_index=i) for i, t in enumerate(turns)
    )
    group = TrajectoryGroup("contract", template.task, trajectories, "w")
    samples = prepare_batch([group], replace(RULES, skip_zero_variance=False), version=0).samples
    trainer = make_trainer(tiny_model_dir, DistContext(), ScaleConfig(logprob_chunk_tokens=5))
    with torch.no_grad():
        batch, logp, _ = trainer.forward(samples)
        untempered = [replace(s, temperature=np.ones_like(s.temperature)) for s in samples]
        _, logp_at_1, _ = trainer.forward(untempered)
    mask = batch["mask"].bool()
    assert int(mask.sum()) == 12 * len(TEMPERATURES)
    error = (logp - batch["behaviour_logp"]).abs() * mask
    assert float(error.max()) < 1e-4, error.max(dim=1).values
    # the temperature matters: scored at 1 instead, the tempered turns would not match
    error_at_1 = ((logp_at_1 - batch["behaviour_logp"]).abs() * mask).max(dim=1).values
    assert [bool(e > 1e-2) for e in error_at_1] == [t not in (0.0, 1.0) for t in TEMPERATURES]
