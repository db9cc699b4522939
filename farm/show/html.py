"""The HTML renderer: a `GroupView` as one self-contained page.

The page has its CSS inline and loads nothing: no script, font, image or stylesheet,
so it opens from a file, a mail attachment or an artefact store alike. Model and
environment text is untrusted (a completion can hold ``<script>``), so every text
goes through `html.escape` (after control characters are written out as ``\\xNN``), and a Content-Security-Policy that allows inline styles
only stops anything the escaping might miss. Trained tokens are marked by colour and
by an underline, and each span's title names its mark and token count.
"""

from __future__ import annotations

from html import escape as _escape

from farm.show.terminal import episode_title, header_rows, turn_title
from farm.show.view import EpisodeView, GroupView, TurnView
from learner.spans import Span, visible

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1d2330; background: #fafbfc; }
h1 { font-size: 20px; margin: 0 0 12px; }
h2 { font-size: 16px; margin: 0; padding: 8px 12px; background: #e8eefb; border-radius: 6px 6px 0 0; }
table.facts { border-collapse: collapse; margin-bottom: 12px; }
table.facts th { text-align: left; padding: 2px 16px 2px 0; color: #4a5468; font-weight: 600; }
table.facts td { padding: 2px 0; }
.legend span { margin-right: 16px; padding: 1px 6px; border-radius: 3px; }
section.episode { border: 1px solid #c9d3e6; border-radius: 6px; margin: 16px 0; background: #fff; }
section.episode.error h2 { background: #fbe3e3; }
.turn { padding: 8px 12px; border-top: 1px solid #eef1f6; }
.turn-head { font-weight: 600; color: #24508f; margin-bottom: 4px; }
pre.tokens { white-space: pre-wrap; word-break: break-word; margin: 0;
  font: 13px/1.5 ui-monospace, SFMono-Regular, Menlo, monospace; }
.prompt { color: #5f6b7f; background: #f1f3f7; }
.trained { color: #0b3d12; background: #c9f0cf; text-decoration: underline #2f9e44; }
.untrained { color: #6b4b00; background: #fff1c2; }
.reasoning { font-style: italic; }
.note { color: #5f6b7f; font-style: italic; }
"""


def escape(text: str) -> str:
    """Text for the page: control characters written out, then HTML-escaped."""
    return _escape(visible(text))


CSP = "default-src 'none'; style-src 'unsafe-inline'"


def _span(span: Span, prompt: bool, reasoning: bool = False) -> str:
    if prompt:
        cls, what = "prompt", "prompt, not trained"
    else:
        cls, what = ("trained", "trained") if span.trained else ("untrained", "not trained")
    if reasoning:
        cls, what = f"{cls} reasoning", f"reasoning, {what}"
    title = f"{what}: {span.tokens} tokens"
    return f'<span class="{cls}" title="{escape(title)}">{escape(span.text)}</span>'


def _turn(turn: TurnView) -> str:
    body = "".join(
        [
            *(_span(s, True) for s in turn.prompt),
            *(_span(s, False, reasoning=True) for s in turn.reasoning),
            *(_span(s, False) for s in turn.completion),
        ]
    )
    return (
        f'<div class="turn" data-turn="{turn.index}">'
        f'<div class="turn-head">{escape(turn_title(turn))}</div>'
        f'<pre class="tokens">{body}</pre></div>'
    )


def _episode(episode: EpisodeView) -> str:
    title = episode_title(episode)
    turns = "".join(_turn(t) for t in episode.turns) or '<div class="turn note">no turns</div>'
    cls = "episode error" if episode.error != "none" else "episode"
    return (
        f'<section class="{cls}" data-episode="{episode.sample_index}">'
        f"<h2>{escape(title)}</h2>{turns}</section>"
    )


def render_html(view: GroupView) -> str:
    """The whole page."""
    facts = "".join(
        f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in header_rows(view)
    )
    notes = "".join(f'<tr><th>note</th><td class="note">{escape(n)}</td></tr>' for n in view.notes)
    legend = (
        '<p class="legend"><span class="prompt">prompt side (loss mask 0)</span>'
        '<span class="trained">trained (loss mask 1)</span>'
        '<span class="untrained">sampled, not trained</span></p>'
    )
    episodes = "".join(_episode(e) for e in view.episodes)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f"<title>group {escape(view.group_id)}</title><style>{CSS}</style></head><body>"
        f"<h1>Trajectory group <code>{escape(view.group_id)}</code></h1>"
        f'<table class="facts">{facts}{notes}</table>{legend}{episodes}</body></html>\n'
    )
