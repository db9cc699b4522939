"""The endpoint's render cache: a conversation an episode already sent is not rendered again,
and what is recorded is what the template makes of it either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.workers.agent_helpers import open_episode, serving

TOOL = {
    "type": "function",
    "function": {"name": "look", "parameters": {"type": "object", "properties": {}}},
}


async def test_a_repeated_conversation_is_rendered_once_per_episode(tiny_model_dir: Path) -> None:
    async with serving(tiny_model_dir, history="drop") as endpoint:
        renders: list[int] = []
        real = endpoint.codec.render_messages

        def counted(*args: Any, **kwargs: Any) -> list[int]:
            ids = real(*args, **kwargs)
            renders.append(len(ids))
            return ids

        endpoint.codec.render_messages = counted  # type: ignore[method-assign]
        record, _, sdk = open_episode(endpoint)
        ask = [{"role": "user", "content": "count"}]
        async with sdk() as client:
            for tools in (None, None, [TOOL], None, [TOOL]):
                extra = {"tools": tools} if tools else {}
                await client.chat.completions.create(model="m", messages=ask, max_tokens=2, **extra)
            assert len(renders) == 2  # one per distinct conversation (the tools differ)
            _, _, other = open_episode(endpoint, name="t/1")
            async with other() as client2:  # another episode has its own cache
                await client2.chat.completions.create(model="m", messages=ask, max_tokens=2)
        assert len(renders) == 3
        prompts = [list(t.prompt_ids) for t in record.turns]
        assert prompts[0] == prompts[1] == prompts[3] and prompts[2] == prompts[4]
        assert prompts[0] == list(real([{"role": "user", "content": "count"}], None))
        assert prompts[0] != prompts[2]
