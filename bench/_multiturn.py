"""The multi-turn row of `bench inference`: concurrent episodes against the CPU policy server,
prefix cache on against off in the same run.

Every episode starts from one shared system prompt plus a short user message of its own; each
turn samples `new_tokens` (EOS ignored), then appends them and a fresh user message to the
prompt, as a multi-turn tool environment does. Reported per server: completion tokens/s over
the whole run and the time until the first episode finished all its turns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp


@dataclass(frozen=True)
class MultiTurn:
    """Shape of the multi-turn load."""

    episodes: int  # concurrent episodes
    turns: int  # completions per episode
    system_tokens: int  # shared prompt every episode starts with
    new_tokens: int  # completion tokens per turn
    user_tokens: int  # tokens appended after each completion (the next observation)


async def _episode(
    session: aiohttp.ClientSession, url: str, load: MultiTurn, index: int
) -> tuple[int, float]:
    """Run one episode; return (completion tokens, finish time on the perf counter)."""
    prompt = [(7 * i) % 200 + 20 for i in range(load.system_tokens)]
    prompt += [(index * 13 + j) % 200 + 20 for j in range(load.user_tokens)]
    produced = 0
    for turn in range(load.turns):
        body = {
            "prompt": prompt,
            "max_tokens": load.new_tokens,
            "ignore_eos": True,
            "seed": index * 1000 + turn,
            "return_token_ids": True,
        }
        async with session.post(url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        tokens = data["choices"][0]["token_ids"]
        produced += len(tokens)
        prompt = (
            prompt + tokens + [(index + turn * 31 + j) % 200 + 20 for j in range(load.user_tokens)]
        )
    return produced, time.perf_counter()


async def run_load(url: str, load: MultiTurn) -> dict[str, float]:
    """Completion tokens/s and seconds to the first finished episode, on one server."""
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=load.episodes + 4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(_episode(session, url, load, i) for i in range(load.episodes))
        )
    ended = max(t for _, t in results)
    return {
        "tok_s": sum(n for n, _ in results) / (ended - started),
        "first_episode_s": min(t for _, t in results) - started,
        "total_s": ended - started,
    }


async def compare(model_dir: Path, load: MultiTurn, kv_cache_mb: float) -> dict[str, Any]:
    """The load on a server with the prefix cache off, then on one with it on (same process)."""
    from inference.config import ServerConfig
    from inference.server import PolicyServer

    out: dict[str, Any] = {}
    for label, budget in (("off", 0.0), ("on", kv_cache_mb)):
        config = ServerConfig(
            model=model_dir, port=0, max_batch_size=max(64, load.episodes), kv_cache_mb=budget
        )
        async with PolicyServer(config) as server:
            result = await run_load(server.url, load)
            stats = server.state.engine.prefix_cache.stats()
        out |= {f"mt_{label}_{key}": value for key, value in result.items()}
        if budget:
            out["mt_hit_rate"] = stats.hit_tokens / max(1, stats.queried_tokens)
            out["mt_cache_mb"] = stats.bytes / 2**20
    out["mt_tok_ratio"] = out["mt_on_tok_s"] / out["mt_off_tok_s"]
    out["mt_first_ratio"] = out["mt_off_first_episode_s"] / out["mt_on_first_episode_s"]
    return out


def table_rows(r: dict[str, Any], load: MultiTurn) -> list[str]:
    """Two rows for `bench inference`'s table: value = cache on, baseline = cache off."""
    shape = f"{load.episodes} eps x {load.turns} turns, {load.system_tokens}-tok prompt"
    return [
        f"{'multi-turn tokens/s, ' + shape:<44}{r['mt_on_tok_s']:>12.0f}{r['mt_off_tok_s']:>12.0f}"
        f"{r['mt_tok_ratio']:>7.1f}x   (baseline: prefix cache off; {load.new_tokens} tok/turn)",
        f"{'multi-turn first episode done (s)':<44}{r['mt_on_first_episode_s']:>12.1f}"
        f"{r['mt_off_first_episode_s']:>12.1f}{r['mt_first_ratio']:>7.1f}x   (off/on; hit rate "
        f"{r['mt_hit_rate']:.0%}, cache {r['mt_cache_mb']:.1f} MiB)",
    ]
