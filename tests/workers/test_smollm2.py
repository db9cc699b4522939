"""SmolLM2-135M-Instruct served by the CPU policy server, driven the way a worker drives it:
the workers' codec renders the ChatML prompt, the workers' generation client samples, and the
next turn's tokens are the codec's diff; the whole conversation equals a fresh rendering."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.client import ClientConfig, GenerationClient, SamplingParams
from tests.workers.conftest import Proc, start_policy_server
from workers.tokens import ChatCodec, load_codec

QUESTION = "What is 7+5? Answer with a number only."


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_policy_server(smollm2_dir, tmp_path_factory.mktemp("smollm2-server"))
    yield proc
    proc.kill()


@pytest.mark.slow
async def test_smollm2_answers_through_the_workers_client(
    smollm2_dir: Path, smollm2_server: Proc
) -> None:
    codec: ChatCodec = load_codec(str(smollm2_dir))
    assert codec.stop_token_ids[0] == codec._tok.convert_tokens_to_ids("<|im_end|>")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=codec.stop_token_ids)
    prompt = codec.initial_prompt(QUESTION, None, None)
    async with GenerationClient([smollm2_server.url], ClientConfig()) as client:
        first = await client.generate(prompt, greedy, session_id="ep")
        assert "12" in codec.decode(first.token_ids)
        assert len(first.logprobs) == len(first.token_ids) and first.weight_versions[0] == 0
        if first.finish_reason == "stop":
            assert first.token_ids[-1] in codec.stop_token_ids
        else:  # the base model rambles past the number; the cut turn gets its <|im_end|>
            assert first.finish_reason == "length" and len(first.token_ids) == 12
        follow = codec.next_prompt(first.token_ids, "Thanks. And 3+4?")
        second = await client.generate(
            [*prompt, *first.token_ids, *follow], greedy, session_id="ep"
        )
    assert "7" in codec.decode(second.token_ids)
    sent = codec.decode([*prompt, *first.token_ids, *follow], skip_special=False)
    assert sent.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert sent.endswith(
        "<|im_end|>\n<|im_start|>user\nThanks. And 3+4?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
async def test_agent_endpoint_records_fresh_renderings_on_chatml(smollm2_dir: Path) -> None:
    """Two calls through the agent endpoint: each recorded call's prompt is the template's
    fresh rendering of that request, whether the second continues the first's segment (the
    reply's text re-tokenizes to the sampled ids) or starts a new one (the fallback)."""
    from tests.workers.agent_helpers import call_prompts, open_episode, render, serving

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    ask = [{"role": "user", "content": QUESTION}]
    async with serving(smollm2_dir) as endpoint:
        record, _, sdk = open_episode(endpoint)
        async with sdk() as api:
            first = await api.chat.completions.create(
                model="m", messages=ask, tools=tools, temperature=0, max_tokens=10
            )
            reply = first.choices[0].message.content or ""
            history = [*ask, {"role": "assistant", "content": reply}]
            history.append({"role": "user", "content": "  Thanks. And 3+4?"})
            await api.chat.completions.create(
                model="m", messages=history, tools=tools, temperature=0, max_tokens=10
            )
        bodies = [{"messages": ask, "tools": tools}, {"messages": history, "tools": tools}]
        fresh = [render(endpoint, b) for b in bodies]
        assert call_prompts(record.turns) == fresh
        system = endpoint.codec.decode(fresh[0], skip_special=False)
        assert '<tools>\n{"type": "function", "function": {"name": "add"' in system
    # With the tool list in its system turn the base model answers, but not always right.
    assert reply and first.choices[0].finish_reason in ("stop", "length")
    assert record.segments in (1, 2) and len(record.turns) == 2
    if record.segments == 1:  # continued: only the new part is prompt-side
        assert len(record.turns[1].prompt_ids) < len(record.turns[0].prompt_ids)
