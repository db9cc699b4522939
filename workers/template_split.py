"""A chat template cut around the contents it renders, so a prompt is built from text pieces.

A `Shape` is one rendering of a message list in which every message's content is a sentinel:
the literal text between the contents (`pieces`) is the template's own, and each turn's text is
those pieces with the turn's contents in their places. A template that writes contents as they
are (ChatML) is `verbatim`: no rendering per turn at all. A template that rewrites them (Llama
and Gemma trim them, Mistral writes tool results as JSON) renders the turn's messages and takes
the contents as the template wrote them from between the same pieces. Either way the text is
then tokenized as one region (`encode_region`), exactly as the template's tokenization of the
whole text would tokenize it, except that a content's control-token strings stay text.

Every shape is checked, when built, against the template's own tokenization on sample contents
(`PROBES`); a template that does not split that way raises `TemplateError`, at start-up for the
shapes a worker needs (`workers.tokens.ChatCodec`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.errors import TemplateError

PROBES = (
    "7",
    "hello world",
    " leading and trailing \n",
    "a\n\nb:{}<>",
    "ünïcödé ✓",
    "  two spaces",
    "\n\nnewlines first",
    "12345 ",
    "\t",
    '{"k": "v"}',
)


def sentinel(i: int) -> str:
    """The stand-in for content `i`: private-use characters, never in a real template."""
    return f"\ue000{i}\ue001"


def skeleton(messages: Sequence[dict[str, Any]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """What makes two message lists one shape: roles and the keys beside the content."""
    return tuple(
        (str(m.get("role")), tuple(sorted(k for k in m if k != "content"))) for m in messages
    )


def fill(messages: Sequence[dict[str, Any]], contents: Sequence[str]) -> list[dict[str, Any]]:
    return [{**m, "content": c} for m, c in zip(messages, contents, strict=True)]


@dataclass(frozen=True)
class Shape:
    """A rendering cut around its contents: pieces[0] + c0 + pieces[1] + ... + pieces[n]."""

    pieces: tuple[str, ...]
    verbatim: bool  # the template writes every content unchanged

    def join(self, contents: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
        """The text with `contents` in place, and each content's (start, end) in it."""
        out, spans, at = [self.pieces[0]], [], len(self.pieces[0])
        for content, piece in zip(contents, self.pieces[1:], strict=True):
            spans.append((at, at + len(content)))
            out += [content, piece]
            at += len(content) + len(piece)
        return "".join(out), spans

    def extract(self, text: str) -> list[tuple[int, int]] | None:
        """Where the contents are in `text`, a rendering of this shape with the contents
        rewritten (None: not found). A template may write a content's edges itself (Mistral
        quotes a tool result unless it is a number), so the outer bounds are where `text`
        stops matching the first and last pieces. The spans only tell `encode_region` which
        control tokens a content wrote; the tokens come from the whole text."""
        first, last = self.pieces[0], self.pieces[-1]
        lo = _common_prefix(text, first)
        hi = len(text) - _common_prefix(text[::-1], last[::-1])
        if hi < lo:
            return None
        spans, at = [], lo
        for piece in self.pieces[1:-1]:
            core = piece.strip(_EDGES) or piece  # without the quotes a template may drop
            found = text.find(core, at, hi)
            if found < 0:
                return None
            spans.append((at, found))
            at = found + len(core)
        spans.append((at, hi))
        return spans


_EDGES = "\"' "  # what a template may write around a content or leave out (JSON quotes)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Joiner:
    """A verbatim shape as token ids: the template's fixed ids between the contents, and around
    each content the template text that shares its tokenizer chunk (no added token between:
    ChatML's `user\\n`), encoded together with it, since BPE merges across that boundary.
    A turn is then one text encoding per content, with control-token strings kept as text."""

    fixed: tuple[tuple[int, ...], ...]  # n + 1 runs of ids
    left: tuple[str, ...]  # per content: the template text before it in its chunk
    right: tuple[str, ...]  # per content: the template text after it in its chunk

    def ids(self, contents: Sequence[str], encode_text: Callable[[str], list[int]]) -> list[int]:
        out = list(self.fixed[0])
        for content, left, right, fixed in zip(
            contents, self.left, self.right, self.fixed[1:], strict=True
        ):
            out += encode_text(left + content + right)
            out += fixed
        return out


def joiner(
    shape: Shape,
    added_spans: Callable[[str], list[tuple[int, int]]],
    encode_parsed: Callable[[str], list[int]],
) -> Joiner | None:
    """`shape`'s pieces cut at their added tokens (`added_spans(text)`: where they are), or
    None when two contents share a chunk (no added token between them)."""
    n = len(shape.pieces) - 1
    fixed, left, right = [], [], []
    for j, piece in enumerate(shape.pieces):
        found = added_spans(piece)
        if not found and 0 < j < n:
            return None
        lo = found[0][0] if found and j > 0 else 0  # a content before: text up to it joins it
        hi = found[-1][1] if found and j < n else len(piece)  # a content after: likewise
        if not found:  # the whole piece joins the content after it (j == 0) or before (j == n)
            lo = hi = 0 if j == 0 else len(piece)
        if j > 0:
            right.append(piece[:lo])
        if j < n:
            left.append(piece[hi:])
        fixed.append(tuple(encode_parsed(piece[lo:hi])) if hi > lo else ())
    return Joiner(tuple(fixed), tuple(left), tuple(right))


def cut(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> Shape:
    """`render` (messages -> the region's text) cut around the contents of `messages`."""
    text = render(fill(messages, [sentinel(i) for i in range(len(messages))]))
    pieces, rest = [], text
    for i in range(len(messages)):
        head, found, rest = rest.partition(sentinel(i))
        if not found or sentinel(i) in rest:
            raise TemplateError("the template does not write each message's content once")
        pieces.append(head)
    return Shape((*pieces, rest), verbatim=True)


def build_shape(
    render: Callable[[list[dict[str, Any]]], str],
    template_ids: Callable[[list[dict[str, Any]]], list[int]],
    encode_region: Callable[[str, list[tuple[int, int]]], list[int]],
    messages: list[dict[str, Any]],
) -> Shape:
    """Cut `render` around the contents of `messages` and check the cut against
    `template_ids` (messages -> the template's ids of the region) on `PROBES`.

    The shape stays `verbatim` only while every probe is written unchanged and the other
    fields of the messages (a tool call id, a name) change nothing around the contents."""
    shape = cut(render, messages)
    verbatim = _fields_inert(render, messages, shape)
    for probe in PROBES:
        filled = fill(messages, [probe] * len(messages))
        rendered = render(filled)
        joined, spans = shape.join([probe] * len(messages))
        if rendered != joined:
            verbatim = False
            found = shape.extract(rendered)
            if found is None:
                raise TemplateError(f"the text around a content depends on the content ({probe!r})")
            spans, joined = found, rendered
        if encode_region(joined, spans) != template_ids(filled):
            raise TemplateError(f"its tokens of {probe!r} differ from the template's own")
    return Shape(shape.pieces, verbatim)


def _fields_inert(
    render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]], shape: Shape
) -> bool:
    """Whether other values of the messages' string fields leave the pieces as they are."""
    changed = [
        {
            k: (v[1:] + v[:1] if isinstance(v, str) and k not in ("role", "content") else v)
            for k, v in m.items()
        }
        for m in messages
    ]
    if changed == messages:
        return True
    try:
        return cut(render, changed).pieces == shape.pieces
    except Exception:  # the template refuses other values (Mistral's 9-character ids)
        return False


def cache_key(*parts: Any) -> str:
    return json.dumps(parts, sort_keys=True, default=str)
