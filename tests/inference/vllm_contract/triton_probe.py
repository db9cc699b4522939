"""Run vLLM 0.33's GPU sampling path (its Triton kernels, interpreted) on given logits.

Started by tests/inference/vllm_contract/triton_sampler.py in a process whose PYTHONPATH holds
the contract environment and Triton (env.py), with ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=""`` (with no GPU driver, vLLM keeps Triton on only in that "distributed"
case: ``vllm/triton_utils/importing.py:51-69``). It reads one JSON object from stdin:
``{"logits": [[...]], "rows": [{"temperature", "top_k", "top_p", "min_p", "allowed"}],
"batches": ["small", "large"], "num_sm": n}`` and writes ``{"temperature": [...],
"logprobs": {"small": [[...]], ...}}``: each row's parameters go through vLLM's own
``SamplingParams`` (which raises a temperature in (0, 0.01) to 0.01 and resets a greedy row's
truncation; the temperature it kept is returned), the logits through
`gpu_sampler.processed` as a batch of that size would on CUDA, and the processed logprobs come
from Model Runner V2's own kernel (``compute_token_logprobs``), -inf as null.
"""

from __future__ import annotations

import json
import math
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

from tests.inference.vllm_contract.gpu_sampler import Row, patch_triton_interpreter, processed


def vllm_row(row: dict) -> Row:
    """The row as vLLM's SamplingParams normalises it."""
    params = SamplingParams(
        temperature=row["temperature"],
        top_k=row["top_k"],
        top_p=row["top_p"],
        min_p=row["min_p"],
        allowed_token_ids=row["allowed"],
    )
    allowed = params.allowed_token_ids
    return Row(
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        None if allowed is None else tuple(allowed),
    )


def main() -> None:
    patch_triton_interpreter()
    request = json.load(sys.stdin)
    logits = torch.tensor(request["logits"], dtype=torch.float32)
    rows = [vllm_row(r) for r in request["rows"]]
    vocab = logits.shape[-1]
    every_token = torch.arange(vocab).repeat(len(rows), 1)
    out: dict[str, list[list[float | None]]] = {}
    for batch in request["batches"]:
        z = processed(logits.clone(), rows, batch, request["num_sm"])
        logprobs = compute_token_logprobs(z, every_token).tolist()
        out[batch] = [[None if math.isinf(v) else v for v in row] for row in logprobs]
    json.dump({"temperature": [r.temperature for r in rows], "logprobs": out}, sys.stdout)


if __name__ == "__main__":
    main()
