"""Per-sequence sampling and the logprobs the server reports, as pure functions of one logits row.

Invariant (the contract with the learner): the reported logprob of a token is
`log_softmax(raw_logits)[token]`: the model's own distribution at temperature 1, before
temperature, top-p or `allowed_token_ids` are applied. That is vLLM's default
`logprobs_mode="raw_logprobs"`, and it is what a plain teacher-forced forward pass
recomputes. The distribution actually sampled from applies, in order: the allowed-token mask,
temperature (0 means greedy), then top-p (nucleus) filtering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleSpec:
    """How one sequence samples its next token."""

    temperature: float  # 0 = greedy (argmax of the masked logits)
    top_p: float  # in (0, 1]; 1 disables nucleus filtering
    allowed: torch.Tensor | None  # 1-D long tensor of allowed token ids, or None for all
    top_logprobs: int  # how many most likely tokens to report besides the sampled one (0 = none)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The reported distribution: log_softmax of the raw float32 logits (vLLM raw_logprobs)."""
    return torch.log_softmax(logits.float(), dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def sample(logits: torch.Tensor, spec: SampleSpec, generator: torch.Generator | None) -> int:
    """Draw one token id from the sampling distribution defined by `spec`."""
    work = logits.float()
    if spec.allowed is not None:
        masked = torch.full_like(work, float("-inf"))
        masked[spec.allowed] = work[spec.allowed]
        work = masked
    if spec.temperature == 0.0:
        return int(torch.argmax(work))
    work = _top_p_filter(work / spec.temperature, spec.top_p)
    probs = torch.softmax(work, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of the raw distribution, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
