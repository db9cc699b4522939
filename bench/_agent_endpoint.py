"""The agent endpoint's CPU per chat call against a direct `generate`, for `bench workers`.

Both sides hit the same latency-simulating server through the same GenerationClient, in
this one process; CPU time is this process's. The endpoint side is a whole chat call as an
agent makes it: a pre-encoded JSON POST from an aiohttp client (the agent's side of the
call, also in this process), the key lookup, validation, chat-template rendering, limits,
generation, recording, detokenization, tool-call parsing and the JSON answer. The direct side
is `client.generate` on an already rendered prompt, as the built-in episode loop calls it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson

from inference.client import SamplingParams
from workers.agent_endpoint import AgentEndpoint, SamplingDefaults
from workers.agent_record import AgentLimits, EpisodeRecord
from workers.episode import EpisodeContext

MESSAGES = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Find the answer and call a tool if you must."},
]
LIMITS = AgentLimits(
    max_calls=10**9, max_completion_tokens=10**12, max_context_tokens=4096, wall_time_s=1e9
)


async def _lanes(n: int, concurrency: int, one: Any) -> None:
    left = iter(range(n))

    async def lane() -> None:
        for _ in left:
            await one()

    async with asyncio.TaskGroup() as tg:
        for k in range(concurrency):
            tg.create_task(lane(), name=f"bench-lane-{k}")


async def measure_endpoint_cpu(ctx: EpisodeContext, calls: int, rounds: int) -> dict[str, float]:
    """Median CPU per call over `rounds` rounds: endpoint chat call vs direct generate."""
    import aiohttp

    endpoint = AgentEndpoint(ctx.codec, ctx.client)
    await endpoint.start()
    key = endpoint.open_episode(EpisodeRecord(LIMITS, 0), "bench", SamplingDefaults(1.0, 1.0, 8))
    body = orjson.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": 8})
    prompt = ctx.codec.render_messages(MESSAGES, None)
    params = SamplingParams(max_tokens=8, stop_token_ids=ctx.codec.stop_token_ids)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = endpoint.base_url + "/chat/completions"
    via, direct = [], []
    try:
        async with aiohttp.ClientSession(headers=headers) as http:

            async def chat() -> None:
                async with http.post(url, data=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"endpoint answered {resp.status}")

            async def generate() -> None:
                await ctx.client.generate(prompt, params, session_id="bench-direct")

            await _lanes(64, 64, chat)  # warm-up: connections, template caches
            for _ in range(rounds):
                for side, one in ((via, chat), (direct, generate)):
                    cpu0 = time.process_time()
                    await _lanes(calls, 64, one)
                    side.append((time.process_time() - cpu0) / calls * 1e6)
    finally:
        endpoint.close_episode(key)
        await endpoint.close()
    return {
        "endpoint_cpu_us_per_call": statistics.median(via),
        "generate_cpu_us_per_call": statistics.median(direct),
    }
