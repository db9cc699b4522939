"""The client's connection limit bounds generations in flight, and lifts aiohttp's 100."""

from __future__ import annotations

import asyncio

from aiohttp import web

from bench._loadgen import LoadGenerator, build_app
from inference.client import GenerationClient, SamplingParams
from inference.config import ClientConfig
from tests.conftest import free_port


async def _peak(max_connections: int, calls: int) -> int:
    gen = LoadGenerator(median_ms=100, sigma=0.01, tokens=2)
    runner = web.AppRunner(build_app(gen))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        config = ClientConfig(max_connections=max_connections, request_timeout_s=30)
        async with GenerationClient([f"http://127.0.0.1:{port}"], config) as client:
            params = SamplingParams(max_tokens=2)
            await asyncio.gather(
                *(client.generate([1, 2], params, session_id=f"s{i}") for i in range(calls))
            )
    finally:
        await runner.cleanup()
    assert gen.requests == calls
    return gen.peak_in_flight


async def test_connection_limit_bounds_requests_in_flight():
    assert await _peak(max_connections=3, calls=12) == 3


async def test_default_limit_is_above_aiohttps_100():
    assert await _peak(max_connections=ClientConfig().max_connections, calls=150) > 100
