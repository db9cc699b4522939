"""Every non-2xx answer becomes an inference error with its status and a short excerpt.

A real aiohttp server answers with whatever status and body an example asks for: vLLM's
OpenAI error object, its auth middleware's `{"error": "Unauthorized"}`, FastAPI's `detail`,
HTML from a proxy, an empty body, broken JSON, bytes that are not UTF-8. The generation client
and the weight sync must turn each into our error, never an AttributeError or a decode error.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.client import ClientConfig, GenerationClient, SamplingParams
from inference.config import WeightSyncConfig
from inference.errors import (
    EXCERPT_CHARS,
    InferenceRequestError,
    InferenceUnavailable,
    WeightSyncError,
    error_excerpt,
)
from inference.weight_sync import FileWeightSync

text = st.text(max_size=400)
ints = st.integers(-(2**63), 2**63 - 1)
json_bodies = st.one_of(
    st.builds(lambda m: {"error": {"message": m, "type": "X", "param": None, "code": 400}}, text),
    st.builds(lambda m: {"error": m}, text),
    st.builds(lambda m: {"detail": m}, text),
    st.builds(lambda m: {"message": m}, text),
    st.builds(lambda v: {"error": v}, st.one_of(st.none(), ints, st.lists(ints))),
    st.lists(ints, max_size=5),
    ints,
    text,
).map(orjson.dumps)
bodies = st.one_of(
    json_bodies,
    st.builds(lambda t: f"<html><body><h1>502 Bad Gateway</h1>{t}</body></html>".encode(), text),
    st.just(b""),
    st.builds(lambda t: b"{" + t.encode(), text),  # broken JSON
    st.binary(max_size=500),
)
statuses = st.sampled_from([400, 401, 403, 404, 409, 413, 422, 500, 502, 503, 504, 408, 429])


@given(bodies)
def test_excerpt_is_short_printable_text_for_any_body(body: bytes) -> None:
    excerpt = error_excerpt(body)
    assert excerpt and len(excerpt) <= EXCERPT_CHARS
    assert "\n" not in excerpt


def test_excerpt_prefers_the_message_of_each_known_shape() -> None:
    assert error_excerpt(b'{"error": {"message": "bad prompt", "code": 400}}') == "bad prompt"
    assert error_excerpt(b'{"error": "Unauthorized"}') == "Unauthorized"
    assert error_excerpt(b'{"detail": "Not Found"}') == "Not Found"
    assert error_excerpt(b"<html>oops</html>") == "<html>oops</html>"
    assert error_excerpt(b"") == "(empty body)"
    assert error_excerpt(b'{"a"') == '{"a"'
    assert error_excerpt(b'{"error": {"message": ""}}') == '{"error": {"message": ""}}'


async def _serve(status: int, body: bytes) -> tuple[web.AppRunner, str]:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def _scenario(status: int, body: bytes, root: Path) -> None:
    runner, url = await _serve(status, body)
    try:
        config = ClientConfig(retry_budget_s=0.2, backoff_initial_s=0.05, health_interval_s=60)
        async with GenerationClient([url], config) as client:
            if 400 <= status < 500 and status not in (408, 429):
                with pytest.raises(InferenceRequestError) as err:
                    await client.generate([1], SamplingParams(max_tokens=1))
                assert err.value.status == status
                assert err.value.message == error_excerpt(body)
            else:
                with pytest.raises(InferenceUnavailable) as unavailable:
                    await client.generate([1], SamplingParams(max_tokens=1))
                assert unavailable.value.status == status
                assert error_excerpt(body) in str(unavailable.value)
        sync = FileWeightSync([url], WeightSyncConfig(root_dir=root, attempts=1, timeout_s=5))
        with pytest.raises(WeightSyncError) as failed:
            await sync.push_path(root, 3)
        assert f"HTTP {status}: {error_excerpt(body)}" in failed.value.failures[url]
    finally:
        await runner.cleanup()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(status=statuses, body=bodies)
def test_any_error_answer_becomes_an_inference_error(
    status: int, body: bytes, tmp_path: Path
) -> None:
    asyncio.run(_scenario(status, body, tmp_path))
