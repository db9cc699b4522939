"""The prompt side of one episode: what the model is fed before each turn.

Two ways to carry earlier turns, the run's choice (`--reasoning-history`):

- ``keep`` (default): the context only grows. Each completion stays verbatim, reasoning and
  all, and what follows it is `ChatCodec.next_prompt` (the template's rendering of the
  observation after a fixed base). One sequence per episode, and no turn is ever re-tokenized.
- ``drop``: before each turn the conversation is rendered in full by the template, with each
  earlier answer as its content (reasoning removed, as a chat client sends it back), so the
  model sees what a chat server would show it. Where that rendering does not extend the tokens
  of the turn before (Qwen3 drops reasoning, Mistral moves the system prompt), the turn starts
  a new segment (`Turn.segment_start`) whose prompt is the whole rendering; the learner trains
  each segment as its own sequence.

Either way the concatenated prompt and completion ids of a segment are exactly what the model
was fed on its last turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from workers.tokens import ChatCodec

History = Literal["keep", "drop"]


class Transcript:
    """One episode's conversation and token context."""

    def __init__(
        self,
        codec: ChatCodec,
        history: History,
        system_prompt: str | None,
        tools: list[dict[str, Any]] | None,
    ) -> None:
        self.codec = codec
        self.history = history
        self.system_prompt = system_prompt
        self.tools = tools
        self.messages: list[dict[str, Any]] = []  # drop mode only: the conversation so far
        self.context: list[int] = []  # what the next generation is fed

    def first(self, observation: Any) -> list[int]:
        """The first prompt's ids."""
        if self.history == "keep":
            prompt = self.codec.initial_prompt(observation, self.system_prompt, self.tools)
        else:
            head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            self.messages = [*head, *self.codec.as_messages(observation)]
            prompt = self.codec.render_conversation(self.messages, self.tools)
        self.context = list(prompt)
        return prompt

    def next(
        self, completion_ids: Sequence[int], answer: str, observation: Any
    ) -> tuple[list[int], bool]:
        """The prompt ids after a completion and the observation that answered it, and
        whether they start a new segment (the whole prompt, not an extension)."""
        if self.history == "keep":
            prompt = self.codec.next_prompt(completion_ids, observation)
            self.context.extend(completion_ids)  # in place: the generation call has returned
            self.context.extend(prompt)
            return prompt, False
        fed = [*self.context, *completion_ids]
        self.messages += [
            {"role": "assistant", "content": answer},
            *self.codec.as_messages(observation),
        ]
        full = self.codec.render_conversation(self.messages, self.tools)
        self.context = full
        if full[: len(fed)] == fed:
            return full[len(fed) :], False
        return full, True
