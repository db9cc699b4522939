"""Prometheus's own graph page, read in a real headless Chromium (Debian's `chromium`).

Grafana cannot be installed here (docs/monitoring.md says why), so the browser check of a
running farm opens the page `farm up --monitor` prints: Debian's Prometheus 2.42 serves
its classic UI there, whose console tab (``g0.tab=1``) runs the query from the page's
JavaScript and fills a table with one row per series. Chromium renders it, runs the
script for up to `budget_ms` of virtual time (which waits on the page's requests), and
prints the resulting DOM; `console_rows` reads the table's rows back.
"""

from __future__ import annotations

import asyncio
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlencode

HEADLESS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")


class _ConsoleTable(HTMLParser):
    """The cells of every row of `table.console_table`'s body."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_body = self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "table" and "console_table" in classes:
            self._in_table = True
        elif self._in_table and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self.rows.append([])
        elif self._in_body and tag == "td":
            self._in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._in_cell = False
        elif tag == "table":
            self._in_table = self._in_body = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data


async def console_rows(
    prometheus_url: str, expr: str, profile: Path, budget_ms: int = 10_000
) -> list[tuple[str, str]]:
    """(series, value) of each row the graph page's console shows for `expr`."""
    page = f"{prometheus_url}/graph?" + urlencode({"g0.expr": expr, "g0.tab": "1"})
    cmd = [
        "chromium",
        *HEADLESS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        page,
    ]
    result = await asyncio.to_thread(
        subprocess.run, cmd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = _ConsoleTable()
    table.feed(result.stdout)
    assert "console_table" in result.stdout, f"no console table on {page}"
    return [(row[0].strip(), row[1].strip()) for row in table.rows if len(row) == 2]
