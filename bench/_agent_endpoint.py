"""The agent endpoint's CPU per chat call against a direct `generate`, for `bench workers`.

Every side hits the same latency-simulating server through the same GenerationClient, in
this one process; CPU time is this process's. The endpoint side is a whole chat call as an
agent in the worker's process makes it, through the in-process transport the worker hands it
(`workers.agent_transport`): the key lookup, validation, chat-template rendering, limits,
generation, recording, detokenization, tool-call parsing, the JSON answer and the httpx
response the agent's client reads. The agent's request is built once, as its body is encoded
once: building requests and reading replies is the agent's client library's work (an httpx
request, or the OpenAI SDK's much larger share), not the endpoint's. The HTTP side is the same
call from an aiohttp client over TCP (what an agent that uses its own HTTP client pays, both
ends in this process). The long side is the in-process call with a tool-using agent's
32-message history, which every call of an agent sends again. The direct side is `client.generate` on an already rendered prompt, as
the built-in episode loop calls it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
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
# a tool-using agent's history after 10 rounds (32 messages): what every call sends again
LONG = [
    MESSAGES[0],
    *(
        m
        for k in range(10)
        for m in (
            {"role": "user", "content": f"Step {k}: run the check."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{k}",
                        "type": "function",
                        "function": {"name": "run", "arguments": '{"code": "print(1)"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"call_{k}", "content": "exit 0"},
        )
    ),
    MESSAGES[1],
]
LIMITS = AgentLimits(
    max_calls=10**9, max_completion_tokens=10**12, max_context_tokens=4096, wall_time_s=1e9
)
One = Callable[[], Awaitable[None]]


async def _lanes(n: int, concurrency: int, one: Any) -> None:
    left = iter(range(n))

    async def lane() -> None:
        for _ in left:
            await one()

    async with asyncio.TaskGroup() as tg:
        for k in range(concurrency):
            tg.create_task(lane(), name=f"bench-lane-{k}")


def _in_process(endpoint: AgentEndpoint, key: str, body: bytes) -> One:
    import httpx

    from workers.agent_transport import EndpointTransport

    transport = EndpointTransport(endpoint)
    url = endpoint.base_url + "/chat/completions"
    request = httpx.Request("POST", url, headers={"Authorization": f"Bearer {key}"}, content=body)

    async def chat() -> None:
        response = await transport.handle_async_request(request)
        await response.aread()
        if response.status_code != 200:
            raise RuntimeError(f"endpoint answered {response.status_code}")

    return chat


async def measure_endpoint_cpu(ctx: EpisodeContext, calls: int, rounds: int) -> dict[str, float]:
    """Median CPU per call over `rounds` rounds: endpoint chat call (in-process, over HTTP)
    vs direct generate."""
    import aiohttp

    endpoint = AgentEndpoint(ctx.codec, ctx.client)
    await endpoint.start()
    key = endpoint.open_episode(EpisodeRecord(LIMITS, 0), "bench", SamplingDefaults(1.0, 1.0, 8))
    body = orjson.dumps({"model": "policy", "messages": MESSAGES, "max_tokens": 8})
    prompt = ctx.codec.render_messages(MESSAGES, None)
    params = SamplingParams(max_tokens=8, stop_token_ids=ctx.codec.stop_token_ids)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = endpoint.base_url + "/chat/completions"
    long = orjson.dumps({"model": "policy", "messages": LONG, "max_tokens": 8})
    sides: dict[str, list[float]] = {
        "endpoint": [],
        "endpoint_long": [],
        "endpoint_http": [],
        "generate": [],
    }
    try:
        async with aiohttp.ClientSession(headers=headers) as http:

            async def over_http() -> None:
                async with http.post(url, data=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"endpoint answered {resp.status}")

            async def generate() -> None:
                await ctx.client.generate(prompt, params, session_id="bench-direct")

            ones = {
                "endpoint": _in_process(endpoint, key, body),
                "endpoint_long": _in_process(endpoint, key, long),
                "endpoint_http": over_http,
                "generate": generate,
            }
            for one in ones.values():  # warm-up: connections, template caches
                await _lanes(64, 64, one)
            for _ in range(rounds):
                for side, one in ones.items():
                    cpu0 = time.process_time()
                    await _lanes(calls, 64, one)
                    sides[side].append((time.process_time() - cpu0) / calls * 1e6)
    finally:
        endpoint.close_episode(key)
        await endpoint.close()
    return {f"{side}_cpu_us_per_call": statistics.median(v) for side, v in sides.items()}
