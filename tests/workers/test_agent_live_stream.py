"""A streamed plain-text reply of the agent endpoint goes out while the model generates it,
and is the reply and the record a whole call gets; a failure after the first chunk is an
error event."""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.conftest import free_port
from tests.workers.agent_helpers import LIMITS, open_episode, serving
from workers.agent_endpoint import SamplingDefaults
from workers.agent_record import EpisodeRecord
from workers.agent_transport import in_process_client

HI = [{"role": "user", "content": "say something long"}]
PRINTABLE = list(range(32, 127))  # no stop token among them: the reply runs to max_tokens


async def test_content_arrives_before_the_call_is_generated_and_equals_the_whole_reply(
    tiny_model_dir: Path,
) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        extra = {"allowed_token_ids": PRINTABLE}
        async with sdk() as api:
            stream = await api.chat.completions.create(
                model="m",
                messages=HI,
                max_tokens=160,
                seed=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            pieces, recorded_at_first = [], None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if recorded_at_first is None:
                        recorded_at_first = len(record.turns)
                    pieces.append(chunk.choices[0].delta.content)
                last = chunk
            whole = await api.chat.completions.create(
                model="m", messages=HI, max_tokens=160, seed=5, extra_body=extra
            )
    # the first content went out before the call was recorded, i.e. before it finished
    assert recorded_at_first == 0 and len(pieces) > 2
    assert "".join(pieces) == whole.choices[0].message.content
    assert last.usage.completion_tokens == whole.usage.completion_tokens == 160
    streamed, plain = record.turns
    assert list(streamed.completion_ids) == list(plain.completion_ids)
    assert set(map(int, streamed.completion_ids)) <= set(PRINTABLE)
    assert list(map(int, streamed.sampling.allowed_token_ids)) == PRINTABLE  # learner mirrors it


async def test_an_inference_failure_after_the_first_chunk_is_an_error_event(
    tiny_model_dir: Path,
) -> None:
    dead = [f"http://127.0.0.1:{free_port()}"]
    async with serving(tiny_model_dir, urls=dead, retry_budget_s=0.3) as endpoint:
        record, key, _ = open_episode(endpoint)
        body = {"model": "m", "messages": HI, "max_tokens": 4, "stream": True}
        asked = {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": True}
        auth = {"Authorization": f"Bearer {key}"}
        async with in_process_client(endpoint) as http:
            reply = await http.post(
                endpoint.base_url + "/chat/completions", content=orjson.dumps(body), headers=auth
            )
            _, other, _ = open_episode(endpoint, name="t/1")  # the first one failed for good
            response = await http.post(
                endpoint.base_url + "/responses",
                content=orjson.dumps(asked),
                headers={"Authorization": f"Bearer {other}"},
            )
    events = [e for e in reply.text.split("\n\n") if e]
    assert reply.status_code == 200 and events[-1] == "data: [DONE]"
    assert orjson.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    error = orjson.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "inference failed" in error["message"]
    assert record.failure is not None and record.turns == []
    kinds = [orjson.loads(line[6:]) for line in response.text.split("\n") if line[:6] == "data: "]
    assert response.status_code == 200
    assert [e["type"] for e in kinds] == ["response.created", "response.in_progress", "error"]
    assert kinds[-1]["code"] == "503" and "inference failed" in kinds[-1]["message"]


async def test_a_streamed_response_sends_its_text_as_it_is_generated(tiny_model_dir: Path) -> None:
    """`/v1/responses` with `stream: true`: the message item opens at the first text, its
    deltas come before the call is recorded, and the events close on the whole Response,
    whose text is the non-streamed one (greedy)."""
    body = {"model": "m", "input": "say something long", "max_output_tokens": 160}
    async with serving(tiny_model_dir) as endpoint:
        record = EpisodeRecord(LIMITS, policy_version=0)
        key = endpoint.open_episode(record, "t/0", SamplingDefaults(0.0, 1.0, 160))
        auth = {"Authorization": f"Bearer {key}"}
        url = endpoint.base_url + "/responses"
        events, recorded_at_first = [], None
        async with in_process_client(endpoint) as http:
            streamed = orjson.dumps(body | {"stream": True})
            async with http.stream("POST", url, content=streamed, headers=auth) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        events.append(orjson.loads(line[6:]))
                        delta = events[-1]["type"] == "response.output_text.delta"
                        if delta and recorded_at_first is None:
                            recorded_at_first = len(record.turns)
            whole = (await http.post(url, content=orjson.dumps(body), headers=auth)).json()
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert recorded_at_first == 0 and kinds.count("response.output_text.delta") > 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e["text"] for e in events if e["type"] == "response.output_text.done")
    assert text == done == final["output"][0]["content"][0]["text"]
    assert text == whole["output"][0]["content"][0]["text"]
    assert final["output"][0]["id"] == events[2]["item"]["id"]
    streamed_turn, plain_turn = record.turns
    assert list(streamed_turn.completion_ids) == list(plain_turn.completion_ids)
    assert final["usage"]["output_tokens"] == len(streamed_turn.completion_ids)
