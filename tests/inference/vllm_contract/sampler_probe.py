"""Run vLLM 0.33's own V1 `Sampler` (``--logprobs-mode processed_logprobs``) on given logits.

Started by tests/inference/vllm_contract/test_vllm_sampler.py in a separate process whose
PYTHONPATH holds the contract environment (env.py). It reads one JSON object from stdin:
``{"logits": [[...]], "rows": [{"temperature", "top_k", "top_p", "min_p", "allowed"}]}`` and
writes ``{"logprobs": [[...]]}``: the full processed logprobs vLLM's sampler returns with
``max_num_logprobs = -1`` (its "whole unsorted distribution" path), -inf as null. Each row's
parameters first go through vLLM's ``SamplingParams`` (a temperature in (0, 0.01) becomes
0.01, a greedy row loses its truncation). Without Triton vLLM takes its PyTorch top-k/top-p
path (``apply_top_k_top_p_pytorch``), its path on CPUs; on a GPU it runs the Triton kernels
(triton_probe.py), which differ only in which tied tokens they keep.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.logits_processor.state import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler


def _min_p(values: list[float]) -> MinPLogitsProcessor:
    """vLLM's min-p processor with its per-request state set as `update_state` would."""
    proc = object.__new__(MinPLogitsProcessor)
    proc.min_p_count = sum(1 for v in values if v)
    proc.min_p = torch.tensor(values, dtype=torch.float32).unsqueeze(1)
    return proc


def normalised(row: dict) -> dict:
    """The row as vLLM's SamplingParams leaves it."""
    params = SamplingParams(
        temperature=row["temperature"], top_k=row["top_k"], top_p=row["top_p"], min_p=row["min_p"]
    )
    fields = ("temperature", "top_k", "top_p", "min_p")
    return row | {name: getattr(params, name) for name in fields}


def metadata(rows: list[dict], vocab: int) -> SamplingMetadata:
    """SamplingMetadata as vLLM's InputBatch builds it for these requests."""
    greedy = [r["temperature"] < _SAMPLING_EPS for r in rows]
    # SamplingParams resets truncation for greedy requests; InputBatch maps "off" top-k to V
    top_k = [
        vocab if g or not 0 < r["top_k"] < vocab else r["top_k"]
        for r, g in zip(rows, greedy, strict=True)
    ]
    top_p = [1.0 if g else r["top_p"] for r, g in zip(rows, greedy, strict=True)]
    min_p = [0.0 if g else r["min_p"] for r, g in zip(rows, greedy, strict=True)]
    mask = None
    if any(r["allowed"] is not None for r in rows):
        mask = torch.zeros((len(rows), vocab), dtype=torch.bool)
        for i, r in enumerate(rows):
            if r["allowed"] is not None:
                mask[i] = True
                mask[i, r["allowed"]] = False  # vLLM's mask is True where a token is NOT allowed
    n = len(rows)
    return SamplingMetadata(
        temperature=torch.tensor([r["temperature"] for r in rows], dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if all(p == 1.0 for p in top_p) else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if all(k == vocab for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=-1,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in rows],
        allowed_token_ids_mask=mask,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([_min_p(min_p)] if any(min_p) else None),
    )


def main() -> None:
    request = json.load(sys.stdin)
    logits = torch.tensor(request["logits"], dtype=torch.float32)
    sampler = Sampler(logprobs_mode="processed_logprobs")
    rows = [normalised(r) for r in request["rows"]]
    out = sampler(logits.clone(), metadata(rows, logits.shape[-1]))
    processed = out.logprobs_tensors.logprobs.tolist()
    rows = [[None if math.isinf(v) else v for v in row] for row in processed]
    json.dump({"logprobs": rows}, sys.stdout)


if __name__ == "__main__":
    main()
