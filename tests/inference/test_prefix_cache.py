"""The prefix cache of the CPU policy server, over real HTTP on the tiny model.

The reference for "same tokens, same logprobs" is a server with the cache off (`--kv-cache-mb 0`)
answering the same seeded requests: a hit must change what is computed, never what is sampled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from inference.prefix_cache import PrefixCache
from tests.inference.conftest import teacher_forced_logprobs
from tests.inference.test_server import post

BLOCK = 16
SYSTEM = [(7 * i) % 200 + 30 for i in range(3 * BLOCK + 5)]  # a shared "system prompt": 53 tokens


def body(prompt: list[int], seed: int, max_tokens: int = 12) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "seed": seed,
        "temperature": 1.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }


async def complete(url: str, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
    status, data = await post(url + "/v1/completions", body(prompt, seed))
    assert status == 200, data
    choice = data["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert torch.allclose(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-5, rtol=0)


def stats(server: Any) -> Any:
    return server.state.engine.prefix_cache.stats()


async def test_hits_and_partial_hits_sample_what_a_cold_server_samples(server_factory) -> None:
    cached, cold = await server_factory(), await server_factory(kv_cache_mb=0)
    first = await complete(cached.url, SYSTEM, seed=3)
    assert stats(cached).hit_tokens == 0 and stats(cached).blocks >= 3
    again = await complete(cached.url, SYSTEM, seed=3)
    assert stats(cached).hit_tokens == 3 * BLOCK  # full hit: only the last 5 tokens prefilled
    assert_same(again, first)
    assert_same(first, await complete(cold.url, SYSTEM, seed=3))
    # The next turn extends prompt + completion: its blocks, completion included, are reused.
    turn2 = SYSTEM + first[0] + [40, 41, 42, 43, 44, 45, 46, 47, 48]
    hits = stats(cached).hit_tokens
    got = await complete(cached.url, turn2, seed=4)
    assert stats(cached).hit_tokens - hits == 4 * BLOCK  # 53 prompt + 11 completion tokens in KV
    assert_same(got, await complete(cold.url, turn2, seed=4))
    # A prompt that diverges inside the second block reuses only the first one.
    fork = SYSTEM[:20] + [250] * 30
    hits = stats(cached).hit_tokens
    got = await complete(cached.url, fork, seed=5)
    assert stats(cached).hit_tokens - hits == BLOCK
    assert_same(got, await complete(cold.url, fork, seed=5))
    assert stats(cold).blocks == 0 and stats(cold).hit_tokens == 0


async def test_eviction_keeps_the_cache_within_its_budget(server_factory) -> None:
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers x (k, v) x kv heads x tokens x head dim x f32
    server = await server_factory(kv_cache_mb=5 * block_bytes / 2**20)
    prompts = [[p] * (2 * BLOCK + 1) for p in (60, 61, 62, 63)]
    for prompt in prompts:  # each leaves 2 prompt blocks (plus completion KV short of a block)
        await complete(server.url, prompt, seed=0)
        assert stats(server).bytes <= 5 * block_bytes
    assert stats(server).evicted_blocks >= 3
    hits = stats(server).hit_tokens
    await complete(server.url, prompts[-1], seed=0)  # the newest survived
    assert stats(server).hit_tokens - hits == 2 * BLOCK
    hits = stats(server).hit_tokens
    await complete(server.url, prompts[0], seed=0)  # the oldest was evicted
    assert stats(server).hit_tokens == hits


async def test_weight_push_and_reset_route_clear_the_cache(
    server_factory, other_model_dir: Path
) -> None:
    server = await server_factory()
    await complete(server.url, SYSTEM, seed=1)
    assert stats(server).blocks > 0
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(other_model_dir)}}
    status, _ = await post(server.url + "/collective_rpc", rpc)
    assert status == 200
    assert stats(server).blocks == 0 and stats(server).bytes == 0
    hits = stats(server).hit_tokens
    tokens, logprobs = await complete(server.url, SYSTEM, seed=1)
    assert stats(server).hit_tokens == hits  # nothing stale was served
    want = teacher_forced_logprobs(other_model_dir, SYSTEM, tokens)
    assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4)
    assert stats(server).blocks > 0
    status, _ = await post(server.url + "/reset_prefix_cache", None)
    assert status == 200
    assert stats(server).blocks == 0
    await complete(server.url, SYSTEM, seed=1)
    assert stats(server).hit_tokens == hits


async def test_concurrent_requests_prefill_a_shared_prefix_once(server_factory) -> None:
    cached, cold = await server_factory(), await server_factory(kv_cache_mb=0)
    prompts = [SYSTEM + [100 + i] * (i + 2) for i in range(8)]

    async def run(url: str) -> list[tuple[list[int], list[float]]]:
        return await asyncio.gather(*(complete(url, p, seed=i) for i, p in enumerate(prompts)))

    got = await run(cached.url)
    # One request prefilled the 3 shared blocks; the 7 others waited one step and reused them.
    assert stats(cached).hit_tokens == 7 * 3 * BLOCK
    for mine, theirs in zip(got, await run(cold.url), strict=True):
        assert_same(mine, theirs)


def test_block_keys_name_the_whole_prefix() -> None:
    cache = PrefixCache(1 << 20, block_size=4)
    a = cache.keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    b = cache.keys([0, 2, 3, 4, 5, 6, 7, 8], 8)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different history
    assert cache.keys([1, 2, 3, 4, 5, 6, 7, 8], 7) == a[:1]
