"""Token ids as text a person reads, cut where the learner's loss mask changes.

`spans` decodes each run of tokens that are all trained or all not on its own, so a
trained span's text is exactly the tokens a loss was taken on. `visible` writes out
control characters. `python -m broker show` (`farm.show`) and the trackers' sample
tables (`learner.tracking.render`) draw the same spans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Decoder = Callable[[Sequence[int]], str]  # token ids -> text

# C0 controls but newline and tab, DEL and C1: a terminal acts on them (an escape sequence
# can clear the screen or set the clipboard), so model text shows them as `\xNN`.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def visible(text: str) -> str:
    """`text` with every control character but newline and tab written out as ``\\xNN``."""
    return text.translate(_CONTROLS)


@dataclass(frozen=True)
class Span:
    """A run of tokens that are all trained or all not."""

    text: str  # decoded, special tokens kept
    tokens: int  # how many tokens
    trained: bool  # loss mask 1: the learner puts loss on these tokens


def spans(ids: np.ndarray, mask: np.ndarray, decode: Decoder) -> tuple[Span, ...]:
    """`ids` cut where the loss mask changes, each run decoded on its own."""
    out: list[Span] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or bool(mask[end]) != bool(mask[start]):
            out.append(Span(decode(ids[start:end].tolist()), end - start, bool(mask[start])))
            start = end
    return tuple(out)
