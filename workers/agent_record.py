"""The exact trajectory of one agent episode, built call by call by the agent endpoint.

Invariants:
- with `--reasoning-history keep` (the default), a call whose messages are the previous call's,
  then the reply it got (content and tool calls as returned), then new messages, is rendered
  as the previous call's tokens, its completion verbatim, and the new messages' tokens after
  it (`ChatCodec.next_prompt`): as a worker's own episode of the same conversation would be.
  `Continuation` remembers what that takes;
- a call whose rendered prompt starts with the current segment's tokens (every earlier
  prompt and completion of it) continues that segment: its Turn's `prompt_ids` are only the
  new tokens (loss mask 0); any other call starts a new segment, whose first Turn has the
  whole prompt and `segment_start=True`;
- `completion_ids` and `logprobs` are the sampled ids and their raw logprobs, never
  re-tokenized; so each segment's concatenated tokens are exactly what the model was sent
  and produced on its last call;
- a call past a limit (calls, completion tokens, context, wall time) is refused with a
  400 before anything is generated, and the record remembers the first limit hit as the
  episode's truncation; after an inference failure every later call is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from broker.messages import Sampling, Truncation, Turn
from inference.client import Generation
from inference.openai.errors import ApiError


@dataclass(frozen=True)
class AgentLimits:
    """Per-episode limits the endpoint enforces on an agent's calls."""

    max_calls: int  # chat completion calls per episode
    max_completion_tokens: int  # generated tokens over the whole episode
    max_context_tokens: int  # prompt + completion tokens of one call
    wall_time_s: float  # seconds from the episode's start; later calls are refused


class LimitReached(ApiError):
    """A call past one of the episode's limits (400, OpenAI's error shape)."""

    def __init__(self, cause: Truncation, message: str) -> None:
        super().__init__(f"episode limit reached ({cause.value}): {message}", "messages")
        self.cause = cause


@dataclass(frozen=True)
class Continuation:
    """The last call, as the next call must repeat it to continue its token sequence."""

    messages: tuple[dict[str, Any], ...]  # its messages, as the template got them
    reply: dict[str, Any]  # the reply it got: content and (name, arguments) of each call
    tools: Any  # its tools, as the template got them
    completion: tuple[int, ...]  # the sampled ids of that reply

    def new_messages(self, messages: list[dict[str, Any]], tools: Any) -> list[dict[str, Any]]:
        """The messages after the reply when `messages` repeat this call and its reply (and
        add some); otherwise empty."""
        n = len(self.messages)
        if tools != self.tools or len(messages) <= n + 1 or tuple(messages[:n]) != self.messages:
            return []
        return messages[n + 1 :] if reply_key(messages[n]) == self.reply else []


def reply_key(message: dict[str, Any]) -> dict[str, Any]:
    """What identifies an assistant reply echoed back: its text and its calls' names and
    arguments (ids and reasoning aside)."""
    calls = [
        (c.get("function", c).get("name"), c.get("function", c).get("arguments"))
        for c in message.get("tool_calls") or ()
    ]
    return {"role": message.get("role"), "content": message.get("content") or "", "calls": calls}


@dataclass
class EpisodeRecord:
    """Turns and budgets of one agent episode."""

    limits: AgentLimits
    policy_version: int  # weight version to record when a server reports none
    started: float = field(default_factory=time.monotonic)
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # the current segment's tokens
    calls: int = 0  # calls admitted
    completion_tokens: int = 0
    segments: int = 0
    truncation: Truncation | None = None  # the first limit a call ran into
    failure: BaseException | None = None  # the inference error that ended the episode
    inference_s: float = 0.0
    closed: bool = False  # the episode ended: late results are not recorded
    last: Continuation | None = None  # the last call, for the next one to continue

    def admit(self, prompt_len: int, requested: int) -> int:
        """Check the limits for a call with a `prompt_len`-token prompt; return its max_tokens."""
        lim = self.limits
        if self.failure is not None:
            raise ApiError(f"inference failed for this episode: {self.failure}", status=503)
        if self.calls >= lim.max_calls:
            self._refuse(Truncation.MAX_TURNS, f"{lim.max_calls} calls")
        if time.monotonic() - self.started >= lim.wall_time_s:
            self._refuse(Truncation.WALL_TIME, f"{lim.wall_time_s} s")
        left = lim.max_completion_tokens - self.completion_tokens
        if left <= 0:
            self._refuse(Truncation.TOKENS, f"{lim.max_completion_tokens} completion tokens")
        room = lim.max_context_tokens - prompt_len
        if room <= 0:
            self._refuse(Truncation.CONTEXT, f"prompt of {prompt_len} tokens")
        self.calls += 1
        return min(requested, room, left)

    def _refuse(self, cause: Truncation, message: str) -> None:
        if self.truncation is None:
            self.truncation = cause
        if self.turns and not self.turns[-1].truncated:
            last = self.turns[-1]
            self.turns[-1] = Turn(**{**_fields(last), "truncated": True})
        raise LimitReached(cause, message)

    def record(
        self, prompt: list[int], gen: Generation, sampling: Sampling, reasoning_tokens: int = 0
    ) -> None:
        """Append the call's Turn: a continuation of the segment, or a new segment."""
        if self.closed:
            return
        n = len(self.context)
        extends = bool(self.context) and len(prompt) >= n and prompt[:n] == self.context
        if not extends:
            self.context = []
            self.segments += 1
        new = prompt[len(self.context) :]
        self.context.extend(new)
        self.context.extend(gen.token_ids)
        self.completion_tokens += len(gen.token_ids)
        versions = [v for v in gen.weight_versions if v >= 0]
        self.turns.append(
            Turn(
                prompt_ids=new,
                completion_ids=gen.token_ids,
                logprobs=gen.logprobs,
                weight_version=min(versions) if versions else self.policy_version,
                reward=0.0,
                terminated=False,
                truncated=False,
                segment_start=not extends and bool(self.turns),
                sampling=sampling,
                cut=gen.finish_reason == "length",
                reasoning_tokens=reasoning_tokens,
            )
        )


def _fields(turn: Turn) -> dict[str, Any]:
    return {name: getattr(turn, name) for name in Turn.__dataclass_fields__}
