"""One request-body path for every JSON route (`inference.openai.body`): malformed JSON, a body
that is not an object and a bad field get the same 400 from the CPU policy server's routes and
from the worker's agent endpoint, the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inference.openai.body import json_body, parse_body
from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest
from inference.server import PolicyServer, ServerConfig
from tests.workers.agent_helpers import open_episode, serving


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "malformed JSON body"),
        (b"\xff\xfe", "malformed JSON body"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'"text"', "request body must be a JSON object"),
        (b"{}", "messages: Field required"),
    ],
)
def test_a_bad_body_is_a_400_that_says_why(raw: bytes, message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        parse_body(raw, ChatCompletionRequest)
    assert caught.value.status == 400


def test_what_only_the_standard_library_reads_is_judged_by_field() -> None:
    """orjson refuses integers past 64 bits and NaN; the fallback reads them, so the model
    judges the field and names it, instead of calling the body malformed."""
    big = b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + str(2**70).encode() + b"}"
    with pytest.raises(ApiError) as caught:
        parse_body(big, ChatCompletionRequest)
    assert caught.value.param == "seed"
    assert json_body(b'{"temperature": NaN}')["temperature"] != 0.0  # NaN, read


def test_an_empty_body_is_an_object_only_where_allowed() -> None:
    assert json_body(b"  ", allow_empty=True) == {}
    with pytest.raises(ApiError, match="malformed JSON body"):
        json_body(b"")


async def test_every_route_answers_a_bad_body_alike(tiny_model_dir: Path) -> None:
    """The CPU server's chat, Responses, tokenize and control routes and the agent endpoint's
    chat and Responses routes: one answer per bad body."""
    server = await PolicyServer(ServerConfig(model=tiny_model_dir, port=0)).start()
    try:
        answers = await _answers(tiny_model_dir, server.url)
    finally:
        await server.stop()
    for raw, got in answers.items():
        assert {status for status, _ in got} == {400}, raw
        assert len({body["error"]["message"] for _, body in got}) == 1, got


async def _answers(model: Path, server_url: str) -> dict[bytes, list[tuple[int, Any]]]:
    async with serving(model, urls=[server_url]) as endpoint:
        _, key, _ = open_episode(endpoint)
        auth = {"Authorization": f"Bearer {key}"}
        targets = [
            (f"{server_url}/v1/chat/completions", {}),
            (f"{server_url}/v1/responses", {}),
            (f"{server_url}/tokenize", {}),
            (f"{server_url}/update_weight_version", {}),
            (f"{endpoint.base_url}/chat/completions", auth),
            (f"{endpoint.base_url}/responses", auth),
        ]
        answers: dict[bytes, list[tuple[int, Any]]] = {}
        async with aiohttp.ClientSession() as http:
            for raw in (b"{not json", b"[1]"):
                for url, headers in targets:
                    async with http.post(url, data=raw, headers=headers) as resp:
                        answers.setdefault(raw, []).append((resp.status, await resp.json()))
    return answers
