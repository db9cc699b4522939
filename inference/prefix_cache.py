"""A prefix cache of KV blocks for the CPU policy engine, shared across requests (vLLM-style).

Tokens are cut into fixed-size blocks; a block's key is a digest of its own tokens chained
onto its parent's key, so a key names the whole prefix up to the block's end and two prompts
share a block only when everything before it is equal too. A block holds the keys and values
of its tokens for every layer in one tensor. Blocks live in an LRU map under a byte budget;
a lookup refreshes a chain from its tail to its head, so the leaves of a chain are evicted
before the prefixes that other chains may still share.

The cache only grows from KV that the current weights produced: `clear()` bumps `epoch`, and
an insert that names an older epoch (a sequence that started before a weight update) is
dropped. Not thread-safe by itself: the engine calls it only under its step lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from inference import metrics

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (heads, tokens, dim)


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache (tests and benchmarks read it; metrics carry the same numbers)."""

    blocks: int  # blocks held
    bytes: int  # bytes of KV held
    queried_tokens: int  # prompt tokens looked up since start
    hit_tokens: int  # of those, tokens served from the cache
    evicted_blocks: int  # blocks dropped to stay under the budget
    epoch: int  # times the cache was cleared


class PrefixCache:
    """KV blocks keyed by token prefix, bounded by `budget_bytes` (0 disables the cache)."""

    def __init__(self, budget_bytes: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be positive")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.epoch = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._queried = 0
        self._hits = 0
        self._evicted = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def keys(self, tokens: list[int], limit: int, salt: bytes = b"") -> list[bytes]:
        """Chained keys of the full blocks of `tokens[:limit]`; `salt` (a LoRA adapter's)
        starts the chain, so blocks computed under different weights never match."""
        out, parent = [], salt
        size = self.block_size
        for end in range(size, min(limit, len(tokens)) + 1, size):
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(array("q", tokens[end - size : end]).tobytes())
            parent = digest.digest()
            out.append(parent)
        return out

    def match(self, keys: list[bytes]) -> tuple[int, KV | None]:
        """The longest cached head of `keys`: (blocks matched, their KV joined, or None)."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        for key in reversed(keys[: len(found)]):
            self._blocks.move_to_end(key)
        if not found:
            return 0, None
        joined = torch.cat(found, dim=3)  # (layers, 2, heads, tokens, dim)
        return len(found), [(layer[0], layer[1]) for layer in joined]

    def count_query(self, queried: int, hit: int) -> None:
        self._queried += queried
        self._hits += hit
        metrics.PREFIX_QUERIED.inc(queried)
        metrics.PREFIX_HITS.inc(hit)

    def insert(self, keys: list[bytes], kv: KV, epoch: int) -> None:
        """Store the blocks of `kv` (which covers at least `len(keys)` blocks) not yet held."""
        if not self.enabled or epoch != self.epoch:
            return
        size = self.block_size
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            span = slice(i * size, (i + 1) * size)
            block = torch.stack([torch.stack([k[:, span], v[:, span]]) for k, v in kv])
            self._blocks[key] = block  # stack copies: the block never pins a sequence's tensor
            self._bytes += block.numel() * block.element_size()
        for key in reversed(keys):
            self._blocks.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.numel() * block.element_size()
            self._evicted += 1
            metrics.PREFIX_EVICTED.inc()
        self._export()

    def clear(self) -> None:
        """Drop every block (weights changed, or `/reset_prefix_cache`)."""
        self._blocks.clear()
        self._bytes = 0
        self.epoch += 1
        self._export()

    def _export(self) -> None:
        metrics.PREFIX_BYTES.set(self._bytes)
        metrics.PREFIX_BLOCKS.set(len(self._blocks))

    def stats(self) -> CacheStats:
        return CacheStats(
            len(self._blocks), self._bytes, self._queried, self._hits, self._evicted, self.epoch
        )
