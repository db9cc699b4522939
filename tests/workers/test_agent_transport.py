"""The in-process path to the agent endpoint: an agent in the worker's process reaches the
endpoint through `OpenAIConfig.client_kwargs()` with no socket, and what is recorded is what
the HTTP path records. Driven by the real `openai` SDK against a real CPU policy server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from broker.messages import FinishReason, Task
from envs.agent import OpenAIConfig
from inference.client import SamplingParams
from tests.workers.agent_helpers import open_episode, serving
from workers.agent_endpoint import AgentEndpoint
from workers.agent_transport import in_process_client
from workers.config import EpisodeSettings
from workers.episode import EpisodeContext
from workers.group import run_group

HI = [{"role": "user", "content": "hi"}]


class _Listener:
    """A TCP port that counts the connections it accepts and closes each at once."""

    accepted = 0

    async def __aenter__(self) -> _Listener:
        async def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            writer.close()

        self._server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()


async def test_an_agent_in_the_worker_process_makes_no_tcp_connection(
    tiny_model_dir: Path,
) -> None:
    """The agents' `base_url` leads to a port that only counts connections: their calls still
    reach the endpoint and are recorded, so none of them went over TCP."""
    spec = json.dumps({"entry": "tests.workers.agents:chatty", "task": {"calls": 3, "reward": 1}})
    task = Task(task_id="t", env_spec=f"agent@{spec}", group_size=2, seed=5, policy_version=0)
    cfg = EpisodeSettings(max_tokens=8, episode_timeout_s=60)
    async with serving(tiny_model_dir) as endpoint, _Listener() as elsewhere:
        endpoint.base_url = elsewhere.url
        ctx = EpisodeContext(endpoint.codec, endpoint.client, SamplingParams, agents=endpoint)
        group = await run_group(ctx, cfg, task, max_turns=8, retries=0, worker_id="w")
    for traj in group.trajectories:
        assert traj.finish_reason is FinishReason.TERMINATED, traj.error_detail
        assert len(traj.turns) == 3 and traj.turns[-1].reward == 1.0
    assert elsewhere.accepted == 0


def _in_process(endpoint: AgentEndpoint, key: str) -> openai.AsyncOpenAI:
    config = OpenAIConfig(endpoint.base_url, key, "m", 0, lambda: in_process_client(endpoint))
    return openai.AsyncOpenAI(**config.client_kwargs())


async def _seeded_calls(api: openai.AsyncOpenAI, **extra: Any) -> list[str]:
    messages: list[dict[str, Any]] = [*HI]
    replies = []
    for k in range(3):
        reply = await api.chat.completions.create(
            model="m", messages=messages, max_tokens=6, seed=11 + k, logprobs=True, **extra
        )
        text = reply.choices[0].message.content or ""
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    return replies


async def test_in_process_calls_record_what_http_calls_record(tiny_model_dir: Path) -> None:
    """The same seeded conversation over HTTP and in process: the same replies, and turns
    equal token for token (prompt, completion, logprobs, segments)."""
    async with serving(tiny_model_dir) as endpoint:
        over_http, _, sdk = open_episode(endpoint, name="t/0")
        async with sdk() as api:
            http_replies = await _seeded_calls(api)
        in_process, key, _ = open_episode(endpoint, name="t/1")
        async with _in_process(endpoint, key) as api:
            local_replies = await _seeded_calls(api)
    assert local_replies == http_replies
    assert len(in_process.turns) == 3 and in_process.turns == over_http.turns
    assert in_process.segments == over_http.segments == 1


async def test_in_process_stream_equals_the_whole_reply(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, key, _ = open_episode(endpoint)
        async with _in_process(endpoint, key) as api:
            whole = await api.chat.completions.create(model="m", messages=HI, max_tokens=6, seed=3)
            stream = await api.chat.completions.create(
                model="m",
                messages=HI,
                max_tokens=6,
                seed=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in choices) == whole.choices[0].message.content
    assert choices[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(record.turns[1].completion_ids)


async def test_in_process_refusals_are_the_http_status_codes(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir) as endpoint:
        record, key, _ = open_episode(endpoint)
        async with _in_process(endpoint, "ep-guessed") as stranger:
            with pytest.raises(openai.AuthenticationError):
                await stranger.chat.completions.create(model="m", messages=HI)
        async with _in_process(endpoint, key) as api:
            with pytest.raises(openai.BadRequestError, match="n must be 1"):
                await api.chat.completions.create(model="m", messages=HI, n=2)
            assert (await api.models.list()).data[0].id == endpoint.model_name
        async with in_process_client(endpoint) as http:
            missing = await http.get(endpoint.base_url + "/nowhere")
            bad = await http.post(
                endpoint.base_url + "/chat/completions",
                content=b"{not json",
                headers={"Authorization": f"Bearer {key}"},
            )
        endpoint.close_episode(key)
        async with _in_process(endpoint, key) as api:
            with pytest.raises(openai.AuthenticationError):
                await api.chat.completions.create(model="m", messages=HI)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    assert record.calls == 0 and record.turns == []


async def test_each_client_kwargs_call_gets_its_own_client(tiny_model_dir: Path) -> None:
    """The SDK closes the client it was given: a second SDK client of the same episode works."""
    async with serving(tiny_model_dir) as endpoint:
        record, key, _ = open_episode(endpoint)
        config = OpenAIConfig(endpoint.base_url, key, "m", 0, lambda: in_process_client(endpoint))
        for _ in range(2):
            async with openai.AsyncOpenAI(**config.client_kwargs()) as api:
                await api.chat.completions.create(model="m", messages=HI, max_tokens=2)
    assert record.calls == 2
