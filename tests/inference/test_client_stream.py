"""Streamed generation: token ids reach the caller while the server generates, and the
whole generation is the one a plain request returns (same seed), across pauses and failover."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from inference.client import GenerationClient, SamplingParams
from inference.completion_stream import StreamedCompletion
from tests.inference.conftest import eventually
from tests.inference.test_client import FAST, swap_weights_mid_generation

NO_EOS = tuple(range(256))  # byte ids only: the tiny model cannot end early


async def test_a_streamed_generation_arrives_in_pieces_and_is_the_plain_one(
    server_factory,
) -> None:
    server = await server_factory()
    params = SamplingParams(max_tokens=48, temperature=0.9, seed=7, allowed_token_ids=NO_EOS)
    pieces: list[list[int]] = []
    running_at_first: list[bool] = []

    def on_tokens(ids) -> None:
        if not pieces:  # the server is still generating when the first ids arrive
            running_at_first.append(bool(server.state.engine._running))
        pieces.append(list(ids))

    async with GenerationClient([server.url], FAST) as client:
        streamed = await client.generate([1, 2, 3], params, on_tokens=on_tokens)
        plain = await client.generate([1, 2, 3], params)
    assert running_at_first == [True] and len(pieces) > 1
    assert [t for piece in pieces for t in piece] == streamed.token_ids
    assert streamed.token_ids == plain.token_ids and len(plain.token_ids) == 48
    assert streamed.logprobs == pytest.approx(plain.logprobs, abs=1e-6)
    assert streamed.weight_versions == plain.weight_versions == [0] * 48
    assert streamed.finish_reason == plain.finish_reason == "length"


async def test_a_stream_cut_by_an_abort_pause_goes_on_under_the_new_version(
    server_factory, other_model_dir
) -> None:
    server = await server_factory()
    delivered: list[int] = []
    async with GenerationClient([server.url], FAST) as client:
        params = SamplingParams(max_tokens=300, allowed_token_ids=NO_EOS)
        task = asyncio.create_task(client.generate([1, 2], params, on_tokens=delivered.extend))
        await eventually(lambda: len(delivered) > 0)
        await swap_weights_mid_generation(server, other_model_dir)
        gen = await asyncio.wait_for(task, 30)
    assert delivered == gen.token_ids and len(gen.token_ids) == 300
    assert gen.weight_versions[0] == 0 and gen.weight_versions[-1] == 1
    assert sorted(gen.weight_versions) == gen.weight_versions


@pytest.mark.slow
async def test_tokens_streamed_before_a_server_died_are_kept(
    process_factory, server_factory
) -> None:
    (one,) = process_factory(1)
    two = await server_factory()
    delivered: list[int] = []
    params = SamplingParams(max_tokens=400, allowed_token_ids=NO_EOS)
    async with GenerationClient([one.url, two.url], FAST) as client:
        task = asyncio.create_task(
            client.generate([5], params, session_id="s", on_tokens=delivered.extend)
        )
        await eventually(lambda: len(delivered) > 0)
        assert not two.state.engine._running  # the first pick is the first server
        one.kill()  # SIGKILL mid-stream: the survivor continues after what was delivered
        gen = await asyncio.wait_for(task, 60)
    assert gen.server == two.url
    assert delivered == gen.token_ids and len(gen.token_ids) == 400
    assert len(gen.logprobs) == len(gen.weight_versions) == 400
    assert set(gen.weight_versions) == {0}  # the CPU server labels every chunk


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(ids: list[int], start: int, finish: str | None = None, spans: bool = True) -> bytes:
    choice = {
        "index": 0,
        "text": "",
        "token_ids": ids,
        "logprobs": {"token_logprobs": [-0.5] * len(ids)},
        "finish_reason": finish,
    }
    if spans:
        choice["weight_versions"] = [{"version": "3", "start": start, "end": start + len(ids)}]
    return _event({"choices": [choice]})


def test_events_split_anywhere_read_the_same() -> None:
    body = _chunk([1, 2], 0) + b": keep-alive\n\n" + _chunk([3], 2, "length") + b"data: [DONE]\n\n"
    for cut in range(1, len(body)):
        got: list[int] = []
        stream = StreamedCompletion(got.extend)
        stream.feed(body[:cut])
        stream.feed(body[cut:].replace(b"\n", b"\r\n"))
        choice = stream.choice()
        assert got == choice["token_ids"] == [1, 2, 3]
        assert choice["finish_reason"] == "length" and len(choice["weight_versions"]) == 2


@pytest.mark.parametrize(
    "body,error",
    [
        (_chunk([1], 0), "ended before"),  # cut off: no finish, no [DONE]
        (_chunk([1], 0, "stop") + b"data: {nope\n\n", "malformed"),
        (_event({"error": {"message": "engine died", "code": 500}}), "error event"),
        (
            _event({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [0]}}]}),
            "do not match",
        ),
    ],
)
def test_a_broken_stream_is_an_error_for_the_retry_path(body: bytes, error: str) -> None:
    stream = StreamedCompletion(lambda ids: None)
    stream.feed(body)
    with pytest.raises(ValueError, match=error):
        stream.choice()
