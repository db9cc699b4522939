"""The `show --html` page, opened in a real headless Chromium (Debian's `chromium`)."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.conftest import require
from tests.farm.show.helpers import arithmetic, make_group

WIDTH, HEIGHT = 1200, 1400
TRAINED_BG = (0xC9, 0xF0, 0xCF)  # .trained in farm/show/html.py
PROMPT_BG = (0xF1, 0xF3, 0xF7)  # .prompt


class Turns(HTMLParser):
    """The text of every `div.turn` in document order, and every element name seen."""

    def __init__(self) -> None:
        super().__init__()
        self.turns: list[str] = []
        self.tags: list[str] = []
        self.title = ""
        self._depth = 0  # open elements inside the current turn; 0: not in a turn
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self._in_title = tag == "title"
        if self._depth:
            self._depth += 1
        elif tag == "div" and ("class", "turn") in attrs:
            self.turns.append("")
            self._depth = 1

    def handle_endtag(self, tag: str) -> None:
        self._in_title = False
        if self._depth:
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._depth:
            self.turns[-1] += data


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    headless = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    cmd = ["chromium", *headless, f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def page(run, codec, tiny_model_dir, tmp_path) -> Path:
    require(shutil.which("chromium") is not None, "chromium")
    run.publish(make_group(codec, "page", arithmetic("H")))
    out = tmp_path / "group.html"
    code, stdout, err = run.cli("show", "--tokenizer", str(tiny_model_dir), "--html", str(out))
    assert code == 0, err
    assert f"to {out}" in stdout
    return out


def test_page_renders_every_turn_in_order_and_no_model_script(page, tmp_path):
    result = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-2000:]
    dom = Turns()
    dom.feed(result.stdout)
    expected = [ep.steps for ep in arithmetic("H")]
    flat = [step for steps in expected for step in steps]
    assert len(dom.turns) == len(flat) == 4
    for text, step in zip(dom.turns, flat, strict=True):
        assert step.observation in text and text.endswith(step.completion + "<|im_end|>"), text
    assert "advantage +1.225" in dom.turns[0] and "advantage -1.225" in dom.turns[3]
    # the completion's <script> is text on the page, not an element, and never ran
    assert "<script>document.title='pwned'</script>" in dom.turns[3]
    assert "script" not in dom.tags
    assert dom.title == "group page"


def test_screenshot_shows_the_marked_turns(page, tmp_path):
    from PIL import Image

    shot = tmp_path / "shot.png"
    size = f"--window-size={WIDTH},{HEIGHT}"
    result = chromium(f"--screenshot={shot}", size, page.as_uri(), profile=tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(shot) as image:
        assert image.size == (WIDTH, HEIGHT)
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=WIDTH * HEIGHT)
    assert colours is not None and len(colours) > 50  # text antialiasing: far from blank
    counts = {rgb: n for n, rgb in colours}
    # the trained spans and the prompt spans were painted with their backgrounds
    assert counts.get(TRAINED_BG, 0) > 2000 and counts.get(PROMPT_BG, 0) > 2000
