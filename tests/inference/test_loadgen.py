"""The benchmark's load generator speaks the shape the real GenerationClient accepts."""

from __future__ import annotations

from aiohttp.test_utils import TestServer

from bench._loadgen import LoadGenerator, build_app
from inference.client import GenerationClient, SamplingParams


async def test_generation_client_accepts_load_generator_replies() -> None:
    server = TestServer(build_app(LoadGenerator(median_ms=1.0, sigma=0.1, tokens=5)))
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        async with GenerationClient([url]) as client:
            params = SamplingParams(max_tokens=5, stop_token_ids=(258,), allowed_token_ids=(49, 50))
            gen = await client.generate([1, 2, 3], params, session_id="s")
    finally:
        await server.close()
    assert len(gen.token_ids) == 5 and gen.token_ids[-1] == 258
    assert set(gen.token_ids[:-1]) <= {49, 50}
    assert len(gen.logprobs) == 5 and gen.weight_versions == [0] * 5
    assert gen.finish_reason == "stop"
