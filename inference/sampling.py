"""The sampled distribution as pure torch functions: the CPU server samples from it, the learner
scores its policy under it. One definition, so the two sides cannot drift.

Invariant (the contract between sampler and learner): a token's reported logprob is its
log-probability under the *processed* distribution it was drawn from, as vLLM 0.33 computes it
on a GPU with ``--logprobs-mode processed_logprobs`` (the default model runner,
``vllm/v1/worker/gpu/sample/sampler.py``): float32 logits, then the allowed-token mask, then,
for a sampled (non-greedy) row, the temperature, min-p, and top-k/top-p in vLLM's Triton
kernels (``vllm/v1/sample/ops/topk_topp_triton.py``), renormalised. A greedy row (temperature
exactly 0; `broker.messages.Sampling` raises (0, 0.01) to 0.01 as vLLM does) reports the masked
logits at temperature 1 and is never truncated (vLLM resets its top-k, top-p and min-p).
`processed_logits` applies all of it; `broker.messages.Sampling` is the record of it.

The kept set of a row is a `Cut`: the tokens whose tempered logit ``z`` is above a value, and
of those *equal* to it only the ones up to a vocabulary index. That is the GPU kernels' tie
rule: min-p keeps ``z >= max z + log(min_p)`` (every tie); top-k keeps exactly k tokens, the
lowest vocabulary indices first among those tied at the k-th value; top-p, over what top-k
kept, keeps the shortest run of tokens in (probability descending, index ascending) order
whose mass reaches p, so only as many tokens tied at the boundary as the mass needs. (vLLM's
PyTorch path, which it takes only where Triton is missing, keeps every top-k tie and an
unspecified subset of top-p ties.) A cut is two numbers per row, so the learner's backward
pass re-applies it without sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.messages import Sampling

LOGPROB_FLOOR = -9999.0  # vLLM's serving layer reports max(logprob, -9999.0)
_ROW_BLOCK = 64  # rows sorted (top-p) or scanned for ties (top-k) at once: bounds [rows, V] buffers
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowSampling:
    """The distribution parameters of N rows as tensors (one entry per row)."""

    temperature: torch.Tensor  # float32; 0: greedy
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
        return self.temperature == 0.0

    def truncates(self) -> bool:
        """Whether any sampled row has top-k, top-p or min-p on (one host sync)."""
        on = (self.top_k > 0) | (self.top_p < 1.0) | (self.min_p > 0.0)
        return bool((on & ~self.greedy).any())


@dataclass(frozen=True)
class Cut:
    """The kept set of each row: ``z > value``, plus the tokens with ``z == value`` at a
    vocabulary index ``<= last``. ``value = -inf`` (and ``last = V - 1``) drops nothing."""

    value: torch.Tensor  # float32 [N]
    last: torch.Tensor  # int64 [N]

    @classmethod
    def none(cls, n: int, vocab: int, device: torch.device) -> Cut:
        """Keeps every token of n rows."""
        return cls(
            torch.full((n,), _NEG_INF, device=device),
            torch.full((n,), vocab - 1, dtype=torch.long, device=device),
        )

    def __getitem__(self, rows: torch.Tensor) -> Cut:
        return Cut(self.value[rows], self.last[rows])

    def dropped(self, z: torch.Tensor) -> torch.Tensor:
        """bool ``[N, V]``: True where ``z`` lies outside the kept set."""
        value = self.value.unsqueeze(-1)
        drop = z < value
        if bool((self.last < z.shape[-1] - 1).any()):  # some row keeps only part of a tie
            tail = torch.arange(z.shape[-1], device=z.device) > self.last.unsqueeze(-1)
            drop |= tail.logical_and_(z == value)
        return drop

    def apply_(self, z: torch.Tensor) -> torch.Tensor:
        """Set `z` to -inf outside the kept set, in place."""
        return z.masked_fill_(self.dropped(z), _NEG_INF)

    def tighter(self, other: Cut) -> Cut:
        """Row by row, the cut that keeps fewer tokens (cuts of the same row are nested)."""
        take = (other.value > self.value) | ((other.value == self.value) & (other.last < self.last))
        return Cut(
            torch.where(take, other.value, self.value), torch.where(take, other.last, self.last)
        )


def effective_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The divisor of the logits: the temperature, or 1 for a greedy row."""
    return torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)


def tempered_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Float32 logits over each row's temperature, -inf outside its allowed set (a new tensor)."""
    z = logits.float() / effective_temperature(rows.temperature).unsqueeze(-1)
    if rows.allowed is not None:
        z.masked_fill_(~rows.allowed, _NEG_INF)
    return z


def keep_cut(z: torch.Tensor, rows: RowSampling) -> Cut:
    """The `Cut` of min-p, then top-k, then top-p on the tempered, masked logits `z`, in vLLM's
    order and with its GPU tie rule. Greedy rows keep every token."""
    n, vocab = z.shape
    sampled = ~rows.greedy
    cut = Cut.none(n, vocab, z.device)
    min_p = torch.where(sampled, rows.min_p, torch.zeros_like(rows.min_p))
    if bool((min_p > 0).any()):  # p_i < min_p * p_max  <=>  z_i < z_max + log(min_p)
        floor = z.max(dim=-1).values + torch.log(min_p)
        cut = Cut(torch.where(min_p > 0, floor, cut.value), cut.last)
    top_k = torch.where(sampled & (rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, 0)
    if bool((top_k > 0).any()):
        cut = cut.tighter(_top_k_cut(z, top_k))
    top_p = torch.where(sampled, rows.top_p, torch.ones_like(rows.top_p))
    nucleus = torch.nonzero(top_p < 1.0).flatten()
    value, last = cut.value.clone(), cut.last.clone()
    for start in range(0, len(nucleus), _ROW_BLOCK):
        idx = nucleus[start : start + _ROW_BLOCK]
        part = cut[idx].apply_(z[idx])  # z[idx] is a copy: top-p sees what top-k kept
        value[idx], last[idx] = _top_p_cut(part, top_p[idx])
    return Cut(value, last)


def _top_k_cut(z: torch.Tensor, top_k: torch.Tensor) -> Cut:
    """Exactly k tokens per row (``top_k`` 0: off), the lowest indices first among ties; a row
    with fewer than k finite logits keeps them all (the kernel skips its search then)."""
    vocab = z.shape[-1]
    kth = z.topk(int(top_k.max()), dim=-1).values
    kth = kth.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))[:, 0]
    on = (top_k > 0) & (kth > _NEG_INF)
    last = torch.full_like(top_k, vocab - 1)
    above = (z > kth.unsqueeze(1)).sum(dim=-1)
    tied = (z == kth.unsqueeze(1)).sum(dim=-1)
    partial = torch.nonzero(on & (above + tied > top_k)).flatten()
    for start in range(0, len(partial), _ROW_BLOCK):
        idx = partial[start : start + _ROW_BLOCK]
        rank = (z[idx] == kth[idx].unsqueeze(1)).cumsum(dim=-1)  # ties seen so far, by index
        wanted = (top_k[idx] - above[idx]).unsqueeze(1)
        last[idx] = (rank < wanted).sum(dim=-1)  # the index of the wanted-th tie
    return Cut(torch.where(on, kth, _NEG_INF), last)


def _top_p_cut(z: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, last) of the shortest run, in (z descending, index ascending) order, whose mass
    reaches top_p: a token is kept while the mass before it is below top_p."""
    ordered, order = z.sort(dim=-1, descending=True, stable=True)
    mass = ordered.softmax(dim=-1).cumsum_(dim=-1)
    before = mass.roll(1, dims=-1)
    before[:, 0] = 0.0
    finite = torch.isfinite(ordered).sum(dim=-1, keepdim=True)
    kept = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    kept = torch.minimum(kept, finite) - 1  # a row's -inf tail is never part of the nucleus
    return ordered.gather(1, kept)[:, 0], order.gather(1, kept)[:, 0]


def processed_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """The logits the sampler draws from and reports under: tempered, masked and truncated
    (-inf outside the kept set). `log_softmax` of the result is vLLM's processed logprobs."""
    z = tempered_logits(logits, rows)
    if rows.truncates():
        keep_cut(z, rows).apply_(z)
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
