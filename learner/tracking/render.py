"""One trajectory as a conversation a person can read: turns decoded, trained tokens marked.

`render_turns` decodes each turn's prompt-side and completion tokens with the run's
tokenizer (any ``decode(ids) -> str``), cutting them into spans by the loss mask with
`learner.spans.spans`, the same cut `python -m broker show` draws. The mask is the one
the learner trained with, per turn; without one the wire contract decides (every
completion token trainable, no prompt-side token). `as_text` writes the turns as plain
text with trained spans between ``⟦ ⟧`` and control characters written out as ``\\xNN``;
the trackers' sample tables use it. No torch, no tokenizer import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from broker.messages import Trajectory
from learner.spans import Decoder, Span, spans, visible

Decode = Decoder  # token ids -> text
TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


@dataclass(frozen=True)
class RenderedTurn:
    """One turn of a trajectory, decoded."""

    index: int  # 0-based position in the trajectory
    prompt: tuple[Span, ...]  # prompt-side tokens (the template, the env's answer): no loss
    completion: tuple[Span, ...]  # the sampled tokens, cut by the loss mask
    reward: float  # the environment's reward for this turn
    advantage: float | None  # mean advantage over its trained tokens (None: none trained)
    weight_version: int  # oldest weights that sampled any of its completion tokens
    reasoning_tokens: int = 0  # completion tokens, from the start, that are reasoning

    @property
    def trained_tokens(self) -> int:
        """Completion tokens a loss was taken on."""
        return sum(s.tokens for s in self.completion if s.trained)


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
        prompt = spans(turn.prompt_ids, np.zeros(len(turn.prompt_ids)), decode)
        completion = spans(turn.completion_ids, mask, decode)
        advantage = None
        if advantages is not None and mask.sum() > 0:
            advantage = float(np.asarray(advantages[k])[mask > 0].mean())
        reward, version = float(turn.reward), turn.weight_version
        turns.append(
            RenderedTurn(k, prompt, completion, reward, advantage, version, turn.reasoning_tokens)
        )
    return turns


def as_text(turns: Sequence[RenderedTurn]) -> str:
    """Plain text, one block per turn: a header line, the prompt side, the completion with
    its trained spans between ⟦ ⟧."""
    blocks = []
    for turn in turns:
        head = f"[turn {turn.index + 1} · weights v{turn.weight_version} · reward {turn.reward:g}"
        if turn.advantage is not None:
            head += f" · advantage {turn.advantage:+.4g}"
        if turn.reasoning_tokens:
            head += f" · reasoning {turn.reasoning_tokens} tokens"
        prompt = "".join(visible(s.text) for s in turn.prompt)
        completion = "".join(
            f"{TRAINED_OPEN}{visible(s.text)}{TRAINED_CLOSE}" if s.trained else visible(s.text)
            for s in turn.completion
        )
        blocks.append(f"{head}]\nprompt: {prompt}\ncompletion: {completion}")
    return "\n\n".join(blocks) if blocks else "(no turns)"
