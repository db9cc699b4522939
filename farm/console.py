"""The farm's terminal output: prefixed child logs and a live status line.

Every line a child prints is shown as ``name | text`` (names padded to one width)
and, when a log directory is given, appended to ``<log_dir>/<name>.log``. On a TTY
the status is one line kept at the bottom of the screen and redrawn in place;
elsewhere (pipes, CI logs) it is printed as an ordinary ``farm status | ...`` line
each time it changes, so logs stay greppable.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, TextIO

_CLEAR_LINE = "\r\x1b[2K"


class Console:
    """Where the supervisor's and children's lines go."""

    def __init__(
        self,
        out: TextIO | None = None,
        *,
        tty: bool | None = None,
        log_dir: Path | None = None,
        echo_children: bool = True,
        name_width: int = 10,
    ) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.log_dir = log_dir
        self.echo_children = echo_children
        self.name_width = name_width
        self._status = ""
        self._files: dict[str, IO[str]] = {}
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def line(self, name: str, text: str) -> None:
        """One output line of process `name` (``farm`` is the supervisor itself)."""
        formatted = f"{name:<{self.name_width}} | {text}"
        if self.log_dir is not None:
            handle = self._files.get(name)
            if handle is None:
                handle = self._files[name] = (self.log_dir / f"{name}.log").open("a")
            handle.write(text + "\n")
            handle.flush()
        if self.echo_children or name == "farm":
            self._emit(formatted)

    def status(self, text: str) -> None:
        if text == self._status:
            return
        self._status = text
        if self.tty:
            self.out.write(_CLEAR_LINE + text)
            self.out.flush()
        else:
            self._emit(f"{'status':<{self.name_width}} | {text}")

    def _emit(self, formatted: str) -> None:
        if self.tty and self._status:
            self.out.write(_CLEAR_LINE + formatted + "\n" + self._status)
        else:
            self.out.write(formatted + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty and self._status:
            self.out.write("\n")
            self.out.flush()
        self._status = ""
        for handle in self._files.values():
            handle.close()
        self._files.clear()
