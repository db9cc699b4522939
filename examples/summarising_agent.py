"""An agent that edits its history between calls, so its episode has several segments.

After every `keep` exchanges it replaces the conversation with a one-line summary (what
context-management agents do). The endpoint sees a prompt that no longer extends the previous
call's tokens and starts a new segment; the learner trains each segment as its own sequence,
all with the episode's advantage. The reward here is a toy one: the fraction of replies that
are short (at most `max_chars` characters), so a run has something to learn.

    agent@{"entry": "examples.summarising_agent:chat", "task": {"rounds": 6, "keep": 2}}
"""

from __future__ import annotations

from typing import Any

import openai

from envs.agent import OpenAIConfig


async def chat(task: dict[str, Any] | None, api: OpenAIConfig) -> dict[str, Any]:
    task = task or {}
    rounds, keep = int(task.get("rounds", 6)), int(task.get("keep", 2))
    max_chars = int(task.get("max_chars", 8))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story, briefly."}]
    short, summaries = 0, 0
    async with openai.AsyncOpenAI(**api.client_kwargs()) as client:
        for k in range(rounds):
            reply = await client.chat.completions.create(
                model=api.model, messages=messages, max_tokens=int(task.get("max_tokens", 16))
            )
            text = reply.choices[0].message.content or ""
            short += len(text.strip()) <= max_chars
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Go on."},
            ]
            if (k + 1) % keep == 0:  # rewrite the history: a summary replaces it
                summaries += 1
                summary = f"Summary so far ({k + 1} parts): {text[:40]}"
                messages = [{"role": "system", "content": summary}, messages[-1]]
    return {"reward": short / rounds, "metrics": {"summaries": float(summaries)}}
