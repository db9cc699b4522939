"""The CPU engine's running decode batch: continuous batching over one persistent KV buffer.

Sequences that are decoding (one new token a step) keep their keys and values in one buffer
per layer, `(rows, kv heads, columns, head dim)`, right-aligned at column `end`: a step writes
every row's new token at column `end` in place and attends over columns `[0, end]` under a
mask that hides each row's left padding. A sequence joins between steps (its prefill's KV is
copied into a free row once) and leaves between steps (the last row moves into its slot), so
a decode step costs one column per row instead of re-padding every sequence's whole cache into
a fresh tensor and the model's cache concatenating it again (`Engine`'s former path, and still
its prefill path).

The buffer is rebuilt (rows re-packed, right-aligned at the longest row) only when it runs out
of columns or rows, when a longer sequence joins, or when the rows left so much padding that
more than half of the attended columns are masked: amortised over the steps between rebuilds.
Columns a row does not own hold zeros or another row's stale, finite KV, never garbage: a masked
position weighs zero, and zero times a non-finite value would not be zero.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (heads, tokens, dim)


class Sequence(Protocol):
    """What the batch uses of a sequence (`inference.sequence.Sequence`, which sits above)."""

    kv: KV | None  # its own KV, until it joins
    pending: list[int]  # the token a step feeds
    batch: DecodeBatch | None  # the batch whose row holds its KV

    @property
    def past_len(self) -> int: ...

    def drop_kv(self) -> None: ...


_MIN_ROOM = 64  # columns a rebuild leaves free at least


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name `model.forward` takes its KV cache under: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def supports_batching(model: torch.nn.Module) -> bool:
    """Whether every layer of `model`'s cache is a plain full-attention layer (sliding-window
    or chunked layers keep the engine's per-step padded cache)."""
    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


class _InPlaceLayer(DynamicLayer):
    """A transformers cache layer over the first `rows` rows of the batch's buffers: `update`
    writes the step's keys and values at column `end` and returns views up to them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, end: int) -> None:
        super().__init__()
        self._buffers, self._rows, self._end = (keys, values), rows, end
        self.keys, self.values = keys[:rows, :, :end], values[:rows, :, :end]
        self.device, self.is_initialized = keys.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._buffers
        new_end = self._end + key_states.shape[-2]
        keys[: self._rows, :, self._end : new_end] = key_states
        values[: self._rows, :, self._end : new_end] = value_states
        self.keys, self.values = keys[: self._rows, :, :new_end], values[: self._rows, :, :new_end]
        return self.keys, self.values


class DecodeBatch:
    """The rows of one decode group (one LoRA adapter, or none) and their KV, kept across steps."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self._lengths: list[int] = []  # tokens in each row's KV
        self._keys: list[torch.Tensor] = []  # per layer (rows, heads, columns, dim)
        self._values: list[torch.Tensor] = []
        self.end = 0  # every row's KV ends here; a step writes this column

    # --- membership (between steps) -----------------------------------------------------------
    def sync(self, group: list[Sequence]) -> list[Sequence]:
        """Make the rows exactly `group`: rows of sequences not in it leave (their KV dropped),
        sequences not in the batch join with their own KV (moved in). The rows, in row order."""
        with torch.inference_mode():  # the buffers are inference tensors, written in place
            self._sync(group)
        return list(self.seqs)

    def _sync(self, group: list[Sequence]) -> None:
        wanted = set(map(id, group))
        for seq in [s for s in self.seqs if id(s) not in wanted]:
            self._remove(seq)
        if not self.seqs:
            self._keys, self._values, self.end = [], [], 0  # an idle batch holds no memory
        elif max(self._lengths) * 2 < self.end:
            self._rebuild(self._keys[0].shape[0], 0)  # mostly padding: re-pack
        for seq in group:
            if seq.batch is not self:
                self._join(seq)

    def take(self, seq: Sequence) -> KV:
        """`seq`'s KV (a copy), and its row leaves the batch."""
        row = self.seqs.index(seq)
        length = self._lengths[row]
        span = slice(self.end - length, self.end)
        with torch.inference_mode():
            kv = [(k[row, :, span].clone(), v[row, :, span].clone()) for k, v in self._layers()]
            self._remove(seq)
        return kv

    def _join(self, seq: Sequence) -> None:
        assert seq.kv is not None and len(seq.pending) == 1, "only a prefilled sequence joins"
        length = seq.past_len
        rows = self._keys[0].shape[0] if self._keys else 0
        if len(self.seqs) == rows or length > self.end:
            grown = max(2 * rows, 4) if len(self.seqs) == rows else rows
            self._rebuild(grown, length, seq.kv[0][0], len(seq.kv))
        row = len(self.seqs)
        span = slice(self.end - length, self.end)
        for (kb, vb), (k, v) in zip(self._layers(), seq.kv, strict=True):
            kb[row, :, span], vb[row, :, span] = k, v
        self.seqs.append(seq)
        self._lengths.append(length)
        seq.drop_kv()  # the batch holds it now
        seq.batch = self

    def _remove(self, seq: Sequence) -> None:
        row, last = self.seqs.index(seq), len(self.seqs) - 1
        if row != last:  # the last row moves into the freed slot
            for kb, vb in self._layers():
                kb[row, :, : self.end] = kb[last, :, : self.end]
                vb[row, :, : self.end] = vb[last, :, : self.end]
            self.seqs[row], self._lengths[row] = self.seqs[last], self._lengths[last]
        self.seqs.pop()
        self._lengths.pop()
        seq.batch = None

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self._keys, self._values, strict=True))

    def _rebuild(
        self,
        rows: int,
        min_end: int,
        template: torch.Tensor | None = None,
        layers: int | None = None,
    ) -> None:
        """New buffers of `rows` rows, the rows re-packed right-aligned at the longest row (or
        `min_end`), with room for at least a quarter as many steps again."""
        end = max([min_end, *self._lengths])
        columns = end + max(_MIN_ROOM, end // 4)
        old = self._layers()
        if template is None:
            template = old[0][0]
        heads, dim = template.shape[-3], template.shape[-1]
        keys, values = [], []
        for layer in range(layers if layers is not None else len(old)):
            kb = template.new_zeros((rows, heads, columns, dim))
            vb = template.new_zeros((rows, heads, columns, dim))
            if layer < len(old):
                for row, length in enumerate(self._lengths):
                    src, dst = slice(self.end - length, self.end), slice(end - length, end)
                    kb[row, :, dst] = old[layer][0][row, :, src]
                    vb[row, :, dst] = old[layer][1][row, :, src]
            keys.append(kb)
            values.append(vb)
        self._keys, self._values, self.end = keys, values, end

    # --- a step (in the engine's forward thread) ----------------------------------------------
    def step_inputs(self, model_config: Any, cache_arg: str) -> dict[str, Any]:
        """The model's keyword arguments for one decode step of every row: the pending tokens,
        the mask over columns `[0, end]`, positions, and the in-place cache (as `cache_arg`)."""
        if self.end >= self._keys[0].shape[2]:
            self._rebuild(self._keys[0].shape[0], 0)
        lengths = torch.tensor(self._lengths)
        columns = torch.arange(self.end + 1)
        cache = DynamicCache(config=model_config)
        rows = len(self.seqs)
        cache.layers[:] = [_InPlaceLayer(k, v, rows, self.end) for k, v in self._layers()]
        return {
            "input_ids": torch.tensor([s.pending[0] for s in self.seqs])[:, None],
            "attention_mask": (columns[None, :] >= (self.end - lengths)[:, None]).long(),
            "position_ids": lengths[:, None],
            cache_arg: cache,
        }

    def advance(self) -> None:
        """After the step's forward: every row's KV is one token longer."""
        self.end += 1
        self._lengths = [n + 1 for n in self._lengths]
