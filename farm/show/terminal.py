"""The terminal renderer: a `GroupView` drawn with rich.

Colour helps but carries nothing alone: every span has a label in the left column
(``prompt``, ``trained``, ``not trained``), so a recording without colour, a pipe or
a colour-blind reader sees the same marks. Model and environment text goes into
`rich.text.Text`, never through console markup, so ``[bold]`` in a completion
prints as written; control characters (an escape sequence could clear the screen
or set the clipboard) are written out as ``\\xNN`` (`learner.spans.visible`).
"""

from __future__ import annotations

import datetime
import os
import sys

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from farm.show.view import EpisodeView, GroupView, TurnView
from learner.spans import Span, visible

STYLE_PROMPT = "dim"
STYLE_TRAINED = "bold green"
STYLE_UNTRAINED = "yellow"


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def header_rows(view: GroupView) -> list[tuple[str, str]]:
    """The group's facts, as (name, value) pairs; the HTML page shows the same."""
    versions = ", ".join(str(v) for v in view.weight_versions) or "none"
    return [
        ("group", view.group_id),
        ("entry", f"{view.entry_id} in {view.origin}"),
        ("env", view.env_spec),
        ("worker", f"{view.worker_id} at {_when(view.created_at)}"),
        ("versions", f"task issued at policy {view.policy_version}; weights {versions}"),
        ("advantage", f"{view.algorithm}, gamma {view.gamma:g}"),
        ("learner", f"skips it: {view.skipped}" if view.skipped else "trains it"),
        ("tokenizer", view.tokenizer or "none: token ids shown"),
    ]


def header(view: GroupView) -> Table:
    """The group's facts as a two-column table."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in header_rows(view):
        table.add_row(key, Text(visible(value)))
    for note in view.notes:
        table.add_row("note", Text(note, style="italic"))
    return table


def _span_rows(table: Table, label: str, spans: tuple[Span, ...], prompt: bool) -> None:
    for span in spans:
        if prompt:
            name, style = label, STYLE_PROMPT
        else:
            name, style = (
                ("trained", STYLE_TRAINED) if span.trained else ("not trained", STYLE_UNTRAINED)
            )
        table.add_row(
            Text(f"{name} ({span.tokens})", style=style), Text(visible(span.text), style=style)
        )


def turn_title(turn: TurnView) -> str:
    """One line of a turn's numbers."""
    marks = {
        "segment start": turn.segment_start,
        "terminated": turn.terminated,
        "truncated": turn.truncated,
        "cut at max tokens": turn.cut,
    }
    parts = [
        f"turn {turn.index}",
        f"weights v{turn.weight_version}",
        turn.sampling,
        f"reward {turn.reward:+.3f}",
        f"advantage {turn.advantage:+.3f}",
    ]
    if turn.shaped_reward != turn.reward:
        parts.insert(4, f"shaped reward {turn.shaped_reward:+.3f}")
    if turn.mean_logprob is not None:
        parts.append(f"mean logprob {turn.mean_logprob:.3f}")
    if turn.reasoning:
        parts.append(f"reasoning {sum(s.tokens for s in turn.reasoning)} tokens")
    return " · ".join(parts + [name for name, on in marks.items() if on])


def turn_block(turn: TurnView) -> RenderableType:
    """A turn: its numbers, then its spans, each labelled."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, min_width=16)
    table.add_column(overflow="fold")
    _span_rows(table, "prompt", turn.prompt, prompt=True)
    if turn.reasoning:
        _span_rows(table, "reasoning", turn.reasoning, prompt=False)
    _span_rows(table, "completion", turn.completion, prompt=False)
    return Group(Text(turn_title(turn), style="bold cyan"), table)


def episode_title(episode: EpisodeView) -> str:
    """One line of an episode's outcome."""
    parts = [f"episode {episode.sample_index}", episode.outcome]
    if episode.error != "none":
        detail = f": {episode.error_detail}" if episode.error_detail else ""
        parts.append(f"error category {episode.error}{detail}")
    parts.append(f"return {episode.episode_return:+.3f}")
    if not episode.trained:
        parts.append("not trained")
    return " · ".join(parts)


def episode_panel(episode: EpisodeView) -> Panel:
    """An episode: its outcome in the title, its turns in order inside."""
    body: list[RenderableType] = [turn_block(t) for t in episode.turns]
    if not body:
        body = [Text("no turns", style="italic")]
    style = "red" if episode.error != "none" else "blue"
    title = Text(visible(episode_title(episode)))
    return Panel(Group(*body), title=title, title_align="left", border_style=style)


def render(view: GroupView, console: Console) -> None:
    """Print the whole group on `console`."""
    console.print(header(view))
    for episode in view.episodes:
        console.print(episode_panel(episode))


class PipeConsole(Console):
    """A console that stops printing quietly when its reader (`head`, `less`) goes away.

    rich's own reaction is `SystemExit(1)` from inside the event loop, which the role's
    TaskGroup reports with a traceback; a reader that has seen enough is not a failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        os.close(devnull)
