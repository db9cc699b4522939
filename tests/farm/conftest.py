"""Fixtures of the farm tests: one tiny model for the end-to-end runs, and a policy server.

The end-to-end tests share the session's tiny model (`tiny_model_dir`, the same model
`python -m inference.tiny` writes: seed 0), passed with `--model`, instead of letting
each `farm` run build its own: a build costs a torch import and a save. The build path
itself is exercised by `farm demo`'s and `farm up`'s default (no `--model`) in docs and
by the inference tests.

`policy_server` is a CPU policy server on that model for tests whose claim is not the
farm's own server (`--inference-urls` makes the farm use it instead of starting one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.workers.conftest import Proc, start_policy_server


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="session")
def policy_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_policy_server(tiny_model, tmp_path_factory.mktemp("farm-server"))
    yield proc
    proc.kill()
