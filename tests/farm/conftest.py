"""Fixtures of the farm tests: one tiny model per session for the end-to-end runs.

Building the model costs a torch import and a save (20 s on a loaded 2-core
machine), so the end-to-end tests share one, passed with `--model`, instead of
letting each `farm` run build its own. The build path itself is exercised by
`farm demo`'s and `farm up`'s default (no `--model`) in docs and by the inference tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("farm-model") / "model"
    subprocess.run(
        [sys.executable, "-m", "inference.tiny", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out
