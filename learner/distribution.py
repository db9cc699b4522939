"""Which distribution each scored token was drawn from, as tensors for the logprob pass.

A turn records the distribution its tokens were sampled from (`broker.messages.Sampling`).
`TokenSampling` carries it per scored token of a micro-batch: the temperature, top-k, top-p
and min-p of each token, and the index of its allowed-token set among the micro-batch's
distinct sets (-1: the whole vocabulary). `rows(start, stop, vocab)` turns a slice of it into
the `inference.sampling.RowSampling` that `processed_logits` applies, so the learner scores
its policy under exactly what the sampler drew from. Prompt-side positions, which no loss
reads, are scored under the plain model (temperature 1, nothing dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from broker.messages import DEFAULT_SAMPLING, Sampling
from inference.sampling import RowSampling


@dataclass(frozen=True)
class TokenSampling:
    """The sampled distribution of N scored tokens."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0: off
    top_p: torch.Tensor  # [N] float32, 1: off
    min_p: torch.Tensor  # [N] float32, 0: off
    allowed_index: torch.Tensor  # [N] int64: row of `allowed_sets`, -1: every token allowed
    allowed_sets: tuple[torch.Tensor, ...] = ()  # int64 token ids of each distinct set
    _tables: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, table: Sequence[Sampling], index: np.ndarray) -> TokenSampling:
        """Per-token tensors from distinct records `table` and each token's row in it."""
        table = [DEFAULT_SAMPLING, *table]  # row 0: the default (index -1 maps to it)
        rows = torch.from_numpy(np.asarray(index, dtype=np.int64) + 1)
        sets: list[np.ndarray] = []
        set_of: list[int] = []
        for s in table:
            ids = s.allowed_token_ids
            if ids is None:
                set_of.append(-1)
                continue
            match = next((k for k, seen in enumerate(sets) if np.array_equal(seen, ids)), None)
            if match is None:
                sets.append(ids)
                match = len(sets) - 1
            set_of.append(match)

        def column(values: list[float | int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)[rows]

        return cls(
            temperature=column([s.temperature for s in table], torch.float32),
            top_k=column([s.top_k for s in table], torch.int64),
            top_p=column([s.top_p for s in table], torch.float32),
            min_p=column([s.min_p for s in table], torch.float32),
            allowed_index=column(set_of, torch.int64),
            allowed_sets=tuple(torch.from_numpy(ids.astype(np.int64)) for ids in sets),
        )

    def to(self, device: torch.device) -> TokenSampling:
        return TokenSampling(
            self.temperature.to(device),
            self.top_k.to(device),
            self.top_p.to(device),
            self.min_p.to(device),
            self.allowed_index.to(device),
            tuple(ids.to(device) for ids in self.allowed_sets),
        )

    def __len__(self) -> int:
        return len(self.temperature)

    def _table(self, vocab: int) -> torch.Tensor:
        """[sets + 1, V] bool: row k + 1 allows set k's tokens, row 0 allows every token."""
        table = self._tables.get(vocab)
        if table is None:
            device = self.temperature.device
            table = torch.zeros(
                (len(self.allowed_sets) + 1, vocab), dtype=torch.bool, device=device
            )
            table[0] = True
            for k, ids in enumerate(self.allowed_sets):
                table[k + 1, ids] = True
            self._tables[vocab] = table
        return table

    def rows(self, start: int, stop: int, vocab: int) -> RowSampling:
        """The distribution parameters of tokens ``start:stop``."""
        index = self.allowed_index[start:stop]
        allowed = None
        if self.allowed_sets and bool((index >= 0).any()):
            allowed = self._table(vocab)[index + 1]
        return RowSampling(
            self.temperature[start:stop],
            self.top_k[start:stop],
            self.top_p[start:stop],
            self.min_p[start:stop],
            allowed,
        )


def merged(parts: Sequence[tuple[Sequence[Sampling], np.ndarray]]) -> TokenSampling:
    """The tokens of several sequences, in order: each part is (its distinct distributions,
    its tokens' rows among them, -1 for the plain model)."""
    table: dict[Sampling, int] = {}
    index: list[np.ndarray] = []
    for samplings, rows in parts:
        remap = np.array([table.setdefault(s, len(table)) for s in samplings] + [-1], np.int64)
        index.append(remap[rows])  # row -1 picks the trailing -1
    flat = np.concatenate(index) if index else np.zeros(0, np.int64)
    return TokenSampling.build(tuple(table), flat)
