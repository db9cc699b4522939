"""Incremental detokenization of one choice, with stop strings and stream hold-back.

`ChoiceText.feed(all_token_ids)` decodes only the tokens added since the last call (a window
that starts a few tokens back, so a character split across byte tokens is emitted once it is
whole, never as U+FFFD), looks for stop strings in the new text, and cuts the text at the first
one. `take()` returns the text not yet handed out, keeping back a tail that could still become
a stop string; `take(final=True)` hands out everything. Invariant: the concatenation of every
`take()` equals `text`, and `text` never contains a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class ChoiceText:
    """The detokenized text of one generated choice, built as tokens arrive."""

    def __init__(self, decode: Decode, stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._prefix = 0  # window start: tokens before it are final text
        self._read = 0  # tokens up to here are in `text`
        self._seen = 0  # tokens fed so far
        self._emitted = 0  # characters of `text` handed out by take()
        self.text = ""
        self.stopped: str | None = None  # the stop string that ended the choice

    def feed(self, tokens: Sequence[int], *, final: bool = False) -> None:
        """Take the choice's whole token list so far; decode what is new."""
        if self.stopped is not None or (len(tokens) == self._seen and not final):
            return
        self._seen = len(tokens)
        window = tokens[self._prefix : self._read]
        before = self._decode(window) if window else ""  # a whole choice fed at once: one decode
        after = self._decode(tokens[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return  # an incomplete character: wait for its next byte
        start = max(0, len(self.text) - self._hold)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(tokens)
        self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> None:
        hits = [(at, s) for s in self._stop if (at := self.text.find(s, start)) >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[:at]
            self.stopped = stop

    def take(self, *, final: bool = False, limit: int | None = None) -> str:
        """Text not handed out yet, minus a tail that may still turn into a stop string,
        and never past `limit` (a caller's own hold-back point) unless final."""
        end = len(self.text) if final or self.stopped else max(0, len(self.text) - self._hold)
        if limit is not None and not final:
            end = min(end, limit)
        end = max(end, self._emitted)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece

    @property
    def emitted(self) -> int:
        """How many characters of `text` take() has handed out."""
        return self._emitted
