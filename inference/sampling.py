"""The sampled distribution as pure torch functions: the CPU server samples from it, the learner
scores its policy under it. One definition, so the two sides cannot drift.

Invariant (the contract between sampler and learner): a token's reported logprob is its
log-probability under the *processed* distribution it was drawn from, as vLLM 0.33 computes it
with ``--logprobs-mode processed_logprobs`` (``vllm/v1/sample/sampler.py``): float32 logits,
then the allowed-token mask, then, for a sampled (non-greedy) row, the temperature, min-p,
top-k and top-p (``ops/topk_topp_sampler.apply_top_k_top_p_pytorch``), renormalised. A greedy
row (temperature below vLLM's 1e-5) reports the masked logits at temperature 1 and is never
truncated (vLLM resets its top-k, top-p and min-p). `processed_logits` applies all of it;
`broker.messages.Sampling` is the record of it on each turn.

Each truncation keeps the tokens at or above a per-row threshold of the tempered logits, so the
kept set is ``allowed & (z >= threshold)``: min-p keeps ``z >= max z + log(min_p)``, top-k the
k-th largest value and up, and top-p, computed as vLLM does (ascending sort, softmax, cumulative
sum, drop while it stays ``<= 1 - p``, keep the last), the smallest kept value and up. A
threshold is one number per row, so the learner's backward pass re-applies it without sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.messages import GREEDY_EPS, Sampling

LOGPROB_FLOOR = -9999.0  # vLLM's serving layer reports max(logprob, -9999.0)
_TOP_P_ROWS = 64  # rows sorted at once for top-p: bounds the [rows, V] sort buffers


@dataclass(frozen=True)
class RowSampling:
    """The distribution parameters of N rows as tensors (one entry per row)."""

    temperature: torch.Tensor  # float32; < GREEDY_EPS: greedy
    top_k: torch.Tensor  # int64; 0: off
    top_p: torch.Tensor  # float32; 1: off
    min_p: torch.Tensor  # float32; 0: off
    allowed: torch.Tensor | None = None  # bool [N, V]: True where allowed; None: every token

    @classmethod
    def of(
        cls, specs: list[Sampling], vocab: int, device: torch.device | None = None
    ) -> RowSampling:
        """Tensors for one row per `Sampling` record."""
        allowed = None
        if any(s.allowed_token_ids is not None for s in specs):
            allowed = torch.ones((len(specs), vocab), dtype=torch.bool, device=device)
            for i, s in enumerate(specs):
                if s.allowed_token_ids is not None:
                    allowed[i] = False
                    allowed[i, torch.as_tensor(s.allowed_token_ids, dtype=torch.long)] = True
        return cls(
            temperature=torch.tensor(
                [s.temperature for s in specs], dtype=torch.float32, device=device
            ),
            top_k=torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device),
            top_p=torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
            min_p=torch.tensor([s.min_p for s in specs], dtype=torch.float32, device=device),
            allowed=allowed,
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature < GREEDY_EPS

    def truncates(self) -> bool:
        """Whether any sampled row has top-k, top-p or min-p on (one host sync)."""
        on = (self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0.0)
        return bool((on & ~self.greedy).any())


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The divisor of the logits: the temperature, or 1 for a greedy row."""
    return torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)


def tempered_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Float32 logits over each row's temperature, -inf outside its allowed set (a new tensor)."""
    z = logits.float() / effective_temperature(rows.temperature).unsqueeze(-1)
    if rows.allowed is not None:
        z.masked_fill_(~rows.allowed, float("-inf"))
    return z


def keep_threshold(z: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Per-row threshold of min-p, top-k and top-p on the tempered, masked logits `z`: the kept
    tokens are those with ``z >= threshold`` (-inf: nothing dropped). Greedy rows keep all."""
    n, vocab = z.shape
    neg_inf = torch.full((n,), float("-inf"), device=z.device)
    sampled = ~rows.greedy
    threshold = neg_inf
    min_p = torch.where(sampled, rows.min_p, torch.zeros_like(rows.min_p))
    if bool((min_p > 0).any()):  # p_i < min_p * p_max  <=>  z_i < z_max + log(min_p)
        floor = z.max(dim=-1).values + torch.log(min_p)
        threshold = torch.where(min_p > 0, floor, neg_inf)
    top_k = torch.where(sampled & (rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, 0)
    if bool((top_k > 0).any()):
        k_max = int(top_k.max())
        kth = z.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))[:, 0]
        threshold = torch.maximum(threshold, torch.where(top_k > 0, kth, neg_inf))
    top_p = torch.where(sampled, rows.top_p, torch.ones_like(rows.top_p))
    nucleus = torch.nonzero(top_p < 1.0).flatten()
    for start in range(0, len(nucleus), _TOP_P_ROWS):
        idx = nucleus[start : start + _TOP_P_ROWS]
        part = z[idx].masked_fill(z[idx] < threshold[idx].unsqueeze(1), float("-inf"))
        threshold[idx] = torch.maximum(threshold[idx], _top_p_floor(part, top_p[idx]))
    return threshold


def _top_p_floor(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest kept value of each row under vLLM's top-p rule (its pytorch reference)."""
    ascending = z.sort(dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False  # at least one token stays
    first_kept = drop.sum(dim=-1, keepdim=True)  # drop is a prefix: its length is the index
    return ascending.gather(1, first_kept)[:, 0]


def processed_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """The logits the sampler draws from and reports under: tempered, masked and truncated
    (-inf outside the kept set). `log_softmax` of the result is vLLM's processed logprobs."""
    z = tempered_logits(logits, rows)
    if rows.truncates():
        threshold = keep_threshold(z, rows)
        z.masked_fill_(z < threshold.unsqueeze(1), float("-inf"))
    return z


@dataclass(frozen=True)
class SampleSpec:
    """How one sequence of the server samples its next token."""

    sampling: Sampling  # the distribution (temperature 0: greedy)
    top_logprobs: int  # how many most likely tokens to report besides the sampled one (0 = none)


def sample_rows(
    logits: torch.Tensor, specs: list[SampleSpec], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Sample one token per row; return (tokens, their processed logprobs, top processed logprobs).

    Work is batched over rows; only rows with their own seeded generator draw one by one.
    """
    rows = RowSampling.of([s.sampling for s in specs], logits.shape[-1], logits.device)
    z = processed_logits(logits, rows)
    logprobs = torch.log_softmax(z, dim=-1)
    greedy = rows.greedy
    tokens = torch.argmax(z, dim=-1)  # final for greedy rows
    sampled = [i for i in range(len(specs)) if not greedy[i]]
    shared = [i for i in sampled if generators[i] is None]
    if shared:
        tokens[shared] = torch.multinomial(logprobs[shared].exp(), 1)[:, 0]
    for i in sampled:
        if generators[i] is not None:
            tokens[i] = torch.multinomial(logprobs[i].exp(), 1, generator=generators[i])[0]
    # -inf outside the kept set is reported as -9999, vLLM's floor (JSON has no infinity)
    logprobs.clamp_(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max(s.top_logprobs for s in specs)
    tops: list[list[tuple[int, float]]] = [[] for _ in specs]
    if k > 0:
        values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        for i, spec in enumerate(specs):
            n = spec.top_logprobs
            tops[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
    return tokens.tolist(), chosen.tolist(), tops
