"""What the CPU engine generates: a request's sampling parameters, its `n` sequences and their
KV caches (their own, or a row of the decode batch), and the future the request resolves through."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inference.sampling import SampleSpec

if TYPE_CHECKING:
    from inference.decode_batch import DecodeBatch
    from inference.lora import LoraAdapter


@dataclass(frozen=True)
class GenParams:
    """Validated sampling parameters of one request (shared by its `n` sequences)."""

    n: int
    max_tokens: int
    spec: SampleSpec
    seed: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool


class Sequence:
    """One choice being generated: its tokens, reported logprobs, versions and KV cache."""

    def __init__(
        self, prompt: list[int], params: GenParams, index: int, adapter: LoraAdapter | None = None
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.adapter = adapter  # the LoRA applied to this sequence (None: base weights)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []
        self.versions: list[str] = []
        self.pending: list[int] = list(prompt)  # tokens not yet in the KV cache
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.batch: DecodeBatch | None = None  # while decoding, its KV is a row of this batch
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cache_epoch = -1  # the prefix cache's epoch when this sequence's KV began
        self.prompt_keys: list[bytes] = []  # prefix-cache keys of the full blocks prefilled first
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Choice i of a seeded request draws from seed + i, so choices differ yet repeat.
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def cache_salt(self) -> bytes:
        """Prefix-cache keys differ per adapter load: KV depends on the weights that made it."""
        return b"" if self.adapter is None else self.adapter.cache_salt

    @property
    def holds_kv(self) -> bool:
        """Whether any of what it saw is in a KV cache: its own, or a decode batch's row."""
        return self.kv is not None or self.batch is not None

    @property
    def past_len(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[1]

    def extend_kv(self, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append per-layer (keys, values) of new tokens; `kv` stays a view of a buffer that
        grows geometrically, so a decode step copies its one new token, not the whole past."""
        old, added = self.past_len, new[0][0].shape[1]
        size = old + added
        if self._buffers is None or self._buffers[0][0].shape[1] < size:
            capacity = max(size, 2 * old, 64)
            buffers = []
            for layer, (k, v) in enumerate(new):
                kb = k.new_empty((k.shape[0], capacity, k.shape[2]))
                vb = v.new_empty((v.shape[0], capacity, v.shape[2]))
                if self.kv is not None:
                    kb[:, :old], vb[:, :old] = self.kv[layer]
                buffers.append((kb, vb))
            self._buffers = buffers
        for (kb, vb), (k, v) in zip(self._buffers, new, strict=True):
            kb[:, old:size], vb[:, old:size] = k, v
        self.kv = [(kb[:, :size], vb[:, :size]) for kb, vb in self._buffers]

    def drop_kv(self) -> None:
        self.kv = self._buffers = None


class GenRequest:
    """A submitted completion: `n` sequences and a future resolved once all have finished."""

    def __init__(
        self, prompt: list[int], params: GenParams, adapter: LoraAdapter | None = None
    ) -> None:
        self.seqs = [Sequence(prompt, params, i, adapter) for i in range(params.n)]
        self.adapter = adapter
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def stepped(self) -> None:
        """Called after each engine step while the request runs; it may finish sequences
        (stop strings). Streaming requests override it; plain token requests do nothing."""

    def resolve(self, error: Exception | None = None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)
