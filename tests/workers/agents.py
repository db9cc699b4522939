"""Agent programs the agent-episode tests run through `agent@{"entry": "tests.workers.agents:..."}`.

Each is written the way a user would: plain `openai.AsyncOpenAI` with the config it is given.
"""

from __future__ import annotations

from typing import Any

import openai

from envs.agent import OpenAIConfig


async def chatty(task: dict[str, Any], api: OpenAIConfig) -> dict[str, Any]:
    """`task["calls"]` turns of a conversation that keeps its history; reward `task["reward"]`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    async with openai.AsyncOpenAI(**api.client_kwargs()) as client:
        for _ in range(task["calls"]):
            reply = await client.chat.completions.create(
                model=api.model, messages=messages, max_tokens=3, seed=api.seed
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "more"},
            ]
    metrics = {"calls": float(task["calls"]), "seed": float(api.seed)}
    return {"reward": task["reward"], "metrics": metrics}


async def forgetful(task: Any, api: OpenAIConfig) -> float:
    """Rewrites its history before every call: each call is a segment of its own."""
    async with openai.AsyncOpenAI(**api.client_kwargs()) as client:
        for k in range(3):
            await client.chat.completions.create(
                model=api.model, messages=[{"role": "user", "content": f"fresh {k}"}], max_tokens=2
            )
    return 1.0


async def greedy(task: Any, api: OpenAIConfig) -> float:
    """Calls until the endpoint refuses, catches the refusal and returns a reward anyway."""
    async with openai.AsyncOpenAI(**api.client_kwargs()) as client:
        while True:
            try:
                await client.chat.completions.create(
                    model=api.model, messages=[{"role": "user", "content": "go"}], max_tokens=2
                )
            except openai.BadRequestError:
                return 0.5


async def crashes(task: Any, api: OpenAIConfig) -> float:
    """One call, then a bug in the agent."""
    async with openai.AsyncOpenAI(**api.client_kwargs()) as client:
        await client.chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    raise KeyError("the agent's own bug")


async def says_yes(task: Any, api: OpenAIConfig) -> Any:
    """Returns something that is not a reward."""
    return "yes"


def not_async(task: Any, api: OpenAIConfig) -> float:
    """A plain function: refused when the spec is built."""
    return 1.0
