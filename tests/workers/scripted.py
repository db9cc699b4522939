"""A scripted stand-in for the model's choices, for the chat-template tests.

A tiny random model cannot be made to write a reasoning block, a Hermes call or a Mistral
`[TOOL_CALLS]` array on cue, and these tests are about the tokens *around* what a model writes:
what the template adds between turns, what the episode records, what the parsers read. So the
completions are scripted token ids (a family's own special tokens included, as a model samples
them) and everything else is real: the worker's episode loop, the codec over the real template
and tokenizer, the environment, the agent endpoint. The model itself is exercised through the
farm in tests/learner/test_chat_template_farm.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference.client import Generation, SamplingParams
from inference.completion_stream import TokenSink


class ScriptedModel:
    """`inference.client.StreamingGenerator` answering each call with the next scripted
    completion (streamed to `on_tokens` in one piece), and keeping every prompt it was fed."""

    def __init__(self, completions: Sequence[Sequence[int]]) -> None:
        self.completions = [list(c) for c in completions]
        self.prompts: list[list[int]] = []

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        session_id: str,
        on_tokens: TokenSink | None = None,
    ) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.completions[len(self.prompts) - 1]
        if on_tokens is not None:
            on_tokens(ids)
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop", "scripted")

    def end_session(self, session_id: str) -> None:
        """Nothing is sticky."""
