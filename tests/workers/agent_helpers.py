"""Shared pieces of the agent tests: an endpoint over a real in-process CPU policy server,
episode records, and the reconstruction of each call's prompt from the recorded turns."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai

from broker.messages import Turn
from inference.client import GenerationClient
from inference.config import ClientConfig
from inference.openai.models import ChatCompletionRequest
from inference.openai.render import render_chat_request
from inference.server import PolicyServer, ServerConfig
from workers.agent_endpoint import AgentEndpoint, SamplingDefaults
from workers.agent_record import AgentLimits, EpisodeRecord
from workers.tokens import load_codec

LIMITS = AgentLimits(
    max_calls=50, max_completion_tokens=10_000, max_context_tokens=4096, wall_time_s=120
)
DEFAULTS = SamplingDefaults(temperature=1.0, top_p=1.0, max_tokens=8)


@asynccontextmanager
async def serving(
    model: Path, urls: list[str] | None = None, retry_budget_s: float = 60, history: str = "keep"
) -> AsyncIterator[AgentEndpoint]:
    """An AgentEndpoint over a real CPU policy server on `model` (or over `urls`)."""
    server = None
    if urls is None:
        server = await PolicyServer(ServerConfig(model=model, port=0)).start()
        urls = [server.url]
    config = ClientConfig(request_timeout_s=60, retry_budget_s=retry_budget_s, backoff_max_s=0.2)
    client = await GenerationClient(urls, config).start()
    endpoint = AgentEndpoint(load_codec(str(model)), client, history=history)  # type: ignore[arg-type]
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.close()
        await client.close()
        if server is not None:
            await server.stop()


def open_episode(
    endpoint: AgentEndpoint, limits: AgentLimits = LIMITS, name: str = "t/0"
) -> tuple[EpisodeRecord, str, Callable[..., openai.AsyncOpenAI]]:
    record = EpisodeRecord(limits, policy_version=0)
    key = endpoint.open_episode(record, name, DEFAULTS)

    def sdk(**kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, **kw)

    return record, key, sdk


def render(endpoint: AgentEndpoint, body: dict[str, Any]) -> list[int]:
    """A fresh rendering of one call, as the template gives it."""
    return render_chat_request(endpoint.codec, ChatCompletionRequest.model_validate(body))


def call_prompts(turns: list[Turn]) -> list[list[int]]:
    """The prompt each recorded call was generated from, rebuilt from the turns alone."""
    prompts, seq = [], []
    for k, turn in enumerate(turns):
        if k == 0 or turn.segment_start:
            seq = [int(t) for t in turn.prompt_ids]
        else:
            seq = [*seq, *map(int, turns[k - 1].completion_ids), *map(int, turn.prompt_ids)]
        prompts.append(list(seq))
    return prompts
