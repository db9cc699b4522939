"""Continuous batching in the CPU engine (`inference.decode_batch`): requests join and leave a
running decode batch whose KV persists between steps, and each samples exactly what it samples
alone.

The staggered load exercises every way the batch changes shape: a request joins mid-decode
with a prompt longer than the batch's KV (the rows are re-packed), more requests join than the
batch has rows (it grows), a short request finishes first (the last row moves into its slot),
and the long ones run past the buffer's spare columns (it is rebuilt with room). The reference
is each request alone, on the batch path and on the engine's per-step padded path (what a
model with sliding-window layers still uses): the same greedy tokens, the same logprobs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.inference.conftest import eventually
from tests.inference.test_server import completion, post

# (prompt, max_tokens); prompts of different lengths, the second longer than the first's KV
LOAD = [
    ([3, 1, 4, 1, 5], 150),
    ([(11 * i) % 250 + 1 for i in range(40)], 120),
    ([9, 2, 6], 6),
    ([(5 * i) % 250 + 2 for i in range(17)], 90),
    ([8], 30),
    ([7, 7, 7, 7, 7, 7, 7, 7], 100),
]


def body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return completion(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def answer(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    status, data = await post(url + "/v1/completions", body(prompt, max_tokens))
    assert status == 200, data
    choice = data["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def generated(server: Any) -> int:
    return sum(len(s.tokens) for r in server.state.engine._running for s in r.seqs)


async def test_requests_joining_and_leaving_sample_what_they_sample_alone(server_factory) -> None:
    batched = await server_factory(kv_cache_mb=0)
    calls = []
    for prompt, max_tokens in LOAD:  # each joins while the ones before it are decoding
        calls.append(asyncio.create_task(answer(batched.url, prompt, max_tokens)))
        mark = generated(batched)
        await eventually(lambda mark=mark: generated(batched) > mark + 2)
    together = await asyncio.gather(*calls)
    engine = batched.state.engine
    assert engine._batches is not None and all(not b.seqs for b in engine._batches.values())

    alone_batched = await server_factory(kv_cache_mb=0)
    padded = await server_factory(kv_cache_mb=0)
    padded.state.engine._batches = None  # the per-step padded cache, as for sliding windows
    for (prompt, max_tokens), got in zip(LOAD, together, strict=True):
        for server in (alone_batched, padded):
            want = await answer(server.url, prompt, max_tokens)
            assert got[0] == want[0]
            torch.testing.assert_close(
                torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-5, rtol=0
            )
        assert len(got[0]) == max_tokens


async def test_a_request_aborted_mid_decode_leaves_the_batch_and_the_rest_finish(
    server_factory,
) -> None:
    server = await server_factory(kv_cache_mb=0)
    engine = server.state.engine
    long = asyncio.create_task(post(server.url + "/v1/completions", body([1, 2, 3], 3000)))
    await eventually(lambda: generated(server) > 3)
    short = asyncio.create_task(answer(server.url, [4, 5], 40))
    await eventually(lambda: sum(len(b.seqs) for b in engine._batches.values()) == 2)
    long.cancel()  # the client goes away: the server aborts the sequence
    await eventually(lambda: sum(len(b.seqs) for b in engine._batches.values()) <= 1)
    tokens, _ = await short
    alone = await server_factory(kv_cache_mb=0)
    assert tokens == (await answer(alone.url, [4, 5], 40))[0]
    await eventually(lambda: not engine._running)
    assert all(not b.seqs for b in engine._batches.values())


async def test_a_failure_after_a_step_fails_the_running_requests_and_the_engine_goes_on(
    server_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in fault: nothing real makes the bookkeeping after a step raise today (an
    # in-place write outside inference mode once did, and every request then hung).
    server = await server_factory(kv_cache_mb=0)
    engine = server.state.engine
    real = engine._cache_finished

    def broken(seq: Any) -> None:
        monkeypatch.setattr(engine, "_cache_finished", real)  # fails once
        raise RuntimeError("bookkeeping broke")

    running = asyncio.create_task(post(server.url + "/v1/completions", body([4, 5, 6], 3000)))
    await eventually(lambda: generated(server) > 3)
    monkeypatch.setattr(engine, "_cache_finished", broken)
    tokens, _ = await answer(server.url, [1, 2, 3], 5)  # finished whole when caching failed
    assert len(tokens) == 5
    status, data = await running  # what was still running is failed, not left hanging
    assert status == 500 and "bookkeeping broke" in data["error"]["message"]
    assert not engine._running and all(not b.seqs for b in engine._batches.values())
    tokens, _ = await answer(server.url, [7, 8], 7)  # the loop still serves
    assert len(tokens) == 7
