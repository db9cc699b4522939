"""Per-sequence sampling and the logprobs the server reports, as pure functions of one logits row.

Invariant (the contract with the learner): the reported logprob of a token is
`log_softmax(raw_logits / t)[token]`, the full-vocabulary distribution at the request's
sampling temperature `t` (`t = 0`, greedy, reports `t = 1`), before top-p or
`allowed_token_ids` are applied. It is what the learner recomputes from the temperature the
worker records on each turn (`learner.logprobs`), and what vLLM's
`--logprobs-mode processed_logprobs` reports whenever no top-k/top-p truncation or token
restriction is in effect. The distribution actually sampled from applies, in order: the
allowed-token mask, temperature (0 means greedy), then top-p (nucleus) filtering.
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


def reported_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The reported distribution: log_softmax of the float32 logits over each row's temperature.

    A row at temperature 0 (greedy) reports the raw distribution, temperature 1.
    """
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.log_softmax(logits.float() / scale[:, None], dim=-1)


def _top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of `logits` with nucleus filtering at their own `top_p` (1 keeps the row whole)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_rows(
    logits: torch.Tensor, specs: list[SampleSpec], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Sample one token per row; return (tokens, their reported logprobs, top reported logprobs).

    Work is batched over rows; only rows with their own seeded generator draw one by one.
    """
    logits = logits.float()
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype)
    logprobs = reported_logprobs(logits, temps)
    work = logits.clone()
    for i, spec in enumerate(specs):
        if spec.allowed is not None:
            row = torch.full_like(work[i], float("-inf"))
            row[spec.allowed] = work[i, spec.allowed]
            work[i] = row
    greedy = temps == 0
    work = work / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    top_p = torch.tensor([s.top_p for s in specs], dtype=work.dtype)
    if bool((top_p < 1).any()):
        work = _top_p_filter(work, top_p)
    tokens = torch.argmax(work, dim=-1)  # final for greedy rows
    sampled = [i for i in range(len(specs)) if not greedy[i]]
    shared = [i for i in sampled if generators[i] is None]
    if shared:
        probs = torch.softmax(work[shared], dim=-1)
        tokens[shared] = torch.multinomial(probs, 1)[:, 0]
    for i in sampled:
        if generators[i] is not None:
            probs = torch.softmax(work[i], dim=-1)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max(s.top_logprobs for s in specs)
    tops: list[list[tuple[int, float]]] = [[] for _ in specs]
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        for i, spec in enumerate(specs):
            n = spec.top_logprobs
            tops[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
    return tokens.tolist(), chosen.tolist(), tops
