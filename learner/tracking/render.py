"""One trajectory as a conversation a person can read: turns decoded, trained tokens marked.

`render_turns` decodes each turn's prompt-side and completion tokens with the run's
tokenizer (any ``decode(ids) -> str``) and splits the completion into spans by whether a
loss was taken on them. Without a mask the wire contract decides: every completion
token is trainable (loss mask 1), every prompt-side token is not. `as_text` writes the
turns as plain text with trained spans between ``⟦ ⟧``; the trackers' sample tables use
it, and any other view (a terminal, a page) can take the `RenderedTurn`s as they are.
No torch, no tokenizer import here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from broker.messages import Trajectory

Decode = Callable[[Sequence[int]], str]
TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one side of a turn, all trained or all not."""

    text: str  # the tokens decoded
    completion: bool  # sampled by the model (False: prompt side, from the env or template)
    trained: bool  # a loss was taken on these tokens


@dataclass(frozen=True)
class RenderedTurn:
    """One turn of a trajectory, decoded."""

    index: int  # 0-based position in the trajectory
    spans: tuple[Span, ...]  # prompt side first, then the completion
    reward: float  # the environment's reward for this turn
    advantage: float | None  # mean advantage over its trained tokens (None: none trained)
    weight_version: int  # oldest weights that sampled any of its completion tokens
    trained_tokens: int  # completion tokens a loss was taken on


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, value) of every run of equal values in a 0/1 mask."""
    flags = mask > 0
    edges = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(flags)]
    return [(a, b, bool(flags[a])) for a, b in itertools.pairwise(edges) if b > a]


def render_turns(
    trajectory: Trajectory,
    decode: Decode,
    masks: Sequence[np.ndarray] | None = None,
    advantages: Sequence[np.ndarray] | None = None,
) -> list[RenderedTurn]:
    """The trajectory's turns decoded. `masks[k]` and `advantages[k]` hold one value per
    completion token of turn k (what the learner trained, and with which advantage);
    without them every completion token counts as trainable and no advantage is shown."""
    turns = []
    for k, turn in enumerate(trajectory.turns):
        n = len(turn.completion_ids)
        mask = np.ones(n, np.float32) if masks is None else np.asarray(masks[k])
        spans = (
            [Span(decode(turn.prompt_ids.tolist()), False, False)] if len(turn.prompt_ids) else []
        )
        ids = turn.completion_ids.tolist()
        spans += [Span(decode(ids[a:b]), True, on) for a, b, on in _runs(mask)]
        advantage = None
        if advantages is not None and mask.sum() > 0:
            advantage = float(np.asarray(advantages[k])[mask > 0].mean())
        trained = int((mask > 0).sum())
        reward = float(turn.reward)
        turns.append(RenderedTurn(k, tuple(spans), reward, advantage, turn.weight_version, trained))
    return turns


def as_text(turns: Sequence[RenderedTurn]) -> str:
    """Plain text, one block per turn: a header line, the prompt side, the completion with
    its trained spans between ⟦ ⟧."""
    blocks = []
    for turn in turns:
        head = f"[turn {turn.index + 1} · weights v{turn.weight_version} · reward {turn.reward:g}"
        if turn.advantage is not None:
            head += f" · advantage {turn.advantage:+.4g}"
        prompt = "".join(s.text for s in turn.spans if not s.completion)
        completion = "".join(
            f"{TRAINED_OPEN}{s.text}{TRAINED_CLOSE}" if s.trained else s.text
            for s in turn.spans
            if s.completion
        )
        blocks.append(f"{head}]\nprompt: {prompt}\ncompletion: {completion}")
    return "\n\n".join(blocks) if blocks else "(no turns)"
