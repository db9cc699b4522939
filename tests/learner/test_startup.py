"""A learner stopped while it starts (its env modules, dataset and torch imports) ends at once."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.slow_import import stop_while_importing


def test_a_learner_stopped_while_importing_ends_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"env_spec": "toy"}) + "\n")
    argv = [
        sys.executable,
        "-m",
        "learner",
        "--redis-url",
        f"redis://127.0.0.1:{free_port()}/0",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        str(tasks),
        "--env-modules",
        "slow_env_module",
        "--metrics-port",
        "0",
    ]
    assert stop_while_importing(argv, tmp_path) == -signal.SIGTERM
