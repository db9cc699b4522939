"""learner.tracking without a learner run: rendering, sample rows, faults, lazy imports.

The full run, read back from both trackers' files, is test_tracking_run.py.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from broker.messages import ErrorCategory, Trajectory, Turn
from learner.batch import prepare_batch
from learner.config import BatchRules
from learner.record import StepRecord
from learner.tracking.base import Tracker
from learner.tracking.config import TrackingConfig
from learner.tracking.render import as_text, render_turns
from learner.tracking.samples import COLUMNS, SampleTable, sample_table
from learner.tracking.tensorboard_backend import TensorBoardBackend, cell
from tests.learner.factories import make_group

ROOT = Path(__file__).resolve().parents[2]


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def turn(prompt: list[int], completion: list[int], reward: float, version: int) -> Turn:
    return Turn(
        prompt_ids=np.array(prompt, np.int32),
        completion_ids=np.array(completion, np.int32),
        logprobs=np.zeros(len(completion), np.float32),
        weight_version=version,
        reward=reward,
        terminated=False,
        truncated=False,
    )


def test_render_marks_the_trained_spans_and_averages_their_advantage() -> None:
    episode = Trajectory(
        turns=(turn([0, 1], [2, 3, 4], 0.0, 3), turn([5], [6, 7], 1.0, 4)),
        finish_reason="terminated",
    )
    masks = [np.array([0.0, 1.0, 1.0]), np.array([1.0, 0.0])]
    advantages = [np.array([9.0, 0.5, 0.25]), np.array([-1.0, 7.0])]
    turns = render_turns(episode, letters, masks, advantages)
    assert [(s.text, s.trained) for s in turns[0].prompt] == [("ab", False)]
    assert [(s.text, s.tokens, s.trained) for s in turns[0].completion] == [
        ("c", 1, False),
        ("de", 2, True),
    ]
    assert turns[0].advantage == 0.375 and turns[1].advantage == -1.0
    assert [t.trained_tokens for t in turns] == [2, 1]
    assert as_text(turns) == (
        "[turn 1 · weights v3 · reward 0 · advantage +0.375]\nprompt: ab\ncompletion: c⟦de⟧\n\n"
        "[turn 2 · weights v4 · reward 1 · advantage -1]\nprompt: f\ncompletion: ⟦g⟧h"
    )
    # without the learner's mask the wire contract decides: every completion token trainable
    plain = render_turns(episode, letters)
    assert as_text(plain).endswith("completion: ⟦gh⟧") and plain[0].advantage is None
    # the reasoning a parser split off a completion is counted in the turn's header
    thought = dataclasses.replace(
        episode, turns=(dataclasses.replace(episode.turns[0], reasoning_tokens=2),)
    )
    assert as_text(render_turns(thought, letters)).startswith(
        "[turn 1 · weights v3 · reward 0 · reasoning 2 tokens]"
    )
    # model text may hold terminal controls: written out, newlines kept
    odd = render_turns(episode, lambda ids: "\x1b[2J\n" if ids == [5] else letters(ids))
    assert "prompt: \\x1b[2J\n" in as_text(odd)


def test_sample_rows_show_trained_and_failed_episodes_with_their_advantages() -> None:
    good = make_group("g", [0.0, 1.0], turns=2, vocab=26)
    later = dataclasses.replace(good.trajectories[1].turns[1], segment_start=True)
    cut = dataclasses.replace(good.trajectories[1], turns=(good.trajectories[1].turns[0], later))
    good = dataclasses.replace(good, trajectories=(good.trajectories[0], cut))
    bad = make_group("f", [1.0, 0.0], vocab=26, error=ErrorCategory.SANDBOX)
    prepared = prepare_batch([good, bad], BatchRules(), 0)
    table = sample_table(5, [good, bad], prepared.samples, 3, letters)
    assert table.columns == COLUMNS and len(table.rows) == 3
    rows = [dict(zip(COLUMNS, row, strict=True)) for row in table.rows]
    assert [(r["group"], r["episode"]) for r in rows] == [("g", 0), ("f", 0), ("g", 1)]
    # GRPO on returns [0, 1]: -+0.5 / (std 0.5 + eps)
    assert rows[0]["advantage"] == pytest.approx(-1.0, abs=1e-5)
    assert rows[2]["advantage"] == pytest.approx(1.0, abs=1e-5)
    assert rows[0]["trained_tokens"] == rows[2]["trained_tokens"] == 6  # the segment's too
    assert rows[1]["advantage"] is None and rows[1]["trained_tokens"] == 0
    assert rows[1]["error"] == "sandbox" and rows[0]["error"] == "none"
    assert rows[2]["reward"] == 1.0 and rows[2]["weight_versions"] == "0,0"
    assert "⟦" not in rows[1]["conversation"] and rows[2]["conversation"].count("⟦") == 2


def test_markdown_cells_keep_the_table_intact() -> None:
    assert cell("a|b\r\nc<|im_end|>*_x_\x1cy") == "a\\|b<br>c&lt;\\|im\\_end\\|&gt;\\*\\_x\\_<br>y"
    assert cell(None) == ""


class DiskFull:
    """Named fault: a backend whose every write fails as a full disk would (ENOSPC)."""

    name = "disk-full"

    def __init__(self) -> None:
        self.calls = 0

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def log_samples(self, table: SampleTable) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failing_backend_is_logged_once_and_dropped_the_others_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = TrackingConfig(tracker=["tensorboard"], tracker_dir=tmp_path, tracker_sample_interval=2)
    board, fault = TensorBoardBackend(cfg, "r", {"run": "r"}), DiskFull()
    tracker = Tracker([fault, board], cfg, lambda: letters)
    groups = [make_group("g", [0.0, 1.0], vocab=26)]
    prepared = prepare_batch(groups, BatchRules(), 0)
    with caplog.at_level(logging.ERROR, logger="learner.tracking"):
        for step in (1, 2, 3):
            tracker.step(
                StepRecord.measure(step, step, 1, prepared, None, wait_s=0.5, push_s=0.0),
                groups,
                prepared,
            )
        tracker.close()
    assert fault.calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        "tracker disk-full failed at step 1; disabled for the rest of the run"
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "r"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/reward_mean")] == [1, 2, 3]
    assert [e.step for e in events.Tensors("samples/text_summary")] == [2]


@pytest.mark.slow
def test_a_real_wandb_crash_does_not_stop_the_other_tracker(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = [
        sys.executable,
        "-m",
        "tests.learner.tracker_crash_job",
        str(tmp_path),
        str(tiny_model_dir),
    ]
    done = subprocess.run(job, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["running"] == ["tensorboard"] and result["dropped_at"] >= 2
    failures = [line for line in done.stderr.splitlines() if "tracker wandb failed" in line]
    assert len(failures) == 1, done.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "crash"))
    events.Reload()
    steps = list(range(1, result["last"] + 1))
    assert [e.step for e in events.Scalars("reward/reward_mean")] == steps


@pytest.mark.slow
def test_tracker_none_imports_neither_library(tiny_model_dir: Path) -> None:
    code = (
        "import sys, json, torch\n"
        "from learner.cli import load_config\n"
        "from learner.distributed import init_distributed\n"
        "from learner.core import build_core\n"
        "from learner.tracking.base import open_tracker\n"
        f"cfg = load_config(['--model', {str(tiny_model_dir)!r}, '--tracker', 'none'])\n"
        "core = build_core(cfg, init_distributed(torch.device('cpu')), torch.device('cpu'))\n"
        "core.tracker = open_tracker(cfg.tracking, cfg.run, {}, cfg.model)\n"
        "print(json.dumps([core.tracker.backends, [m for m in sys.modules\n"
        "    if m.split('.')[0] in ('wandb', 'tensorboard', 'tensorboardX')]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [[], []]


def test_tracker_options_resolve_from_flags_variables_and_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner.cli import load_config
    from learner.errors import ConfigError

    def trackers(*argv: str) -> list[str]:
        return [str(k) for k in load_config(["--model", "/m", *argv]).tracking.tracker]

    assert trackers("--tracker", "wandb", "--tracker", "tensorboard") == ["wandb", "tensorboard"]
    assert trackers("--tracker", "tensorboard,wandb,tensorboard") == ["tensorboard", "wandb"]
    assert trackers("--tracker", "none") == [] and trackers() == []
    monkeypatch.setenv("FARM_TRACKER", "wandb,tensorboard")
    assert trackers() == ["wandb", "tensorboard"] and trackers("--tracker", "none") == []
    monkeypatch.delenv("FARM_TRACKER")
    toml = tmp_path / "l.toml"
    toml.write_text('model = "/m"\n[tracking]\ntracker = ["wandb"]\ntracker_sample_rows = 2\n')
    cfg = load_config(["--config", str(toml)])
    assert cfg.tracking.tracker == ["wandb"] and cfg.tracking.tracker_sample_rows == 2
    for bad, why in (
        (["--tracker", "none,wandb"], "'none' cannot be combined"),
        (["--tracker", "mlflow"], "tracker: Input should be"),
        (["--tracker-sample-rows", "0"], "tracker_sample_rows"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(["--model", "/m", *bad])


def test_without_a_tokenizer_sample_tables_stop_and_the_figures_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.tracking.base import tokenizer_decoder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()  # a model directory without a tokenizer: loading it fails for real
    cfg = TrackingConfig(tracker=["tensorboard"], tracker_dir=tmp_path, tracker_sample_interval=1)
    tracker = Tracker([TensorBoardBackend(cfg, "r", {})], cfg, tokenizer_decoder(empty))
    groups = [make_group("g", [0.0, 1.0], vocab=26)]
    prepared = prepare_batch(groups, BatchRules(), 0)
    with caplog.at_level(logging.ERROR, logger="learner.tracking"):
        for step in (1, 2):
            tracker.step(
                StepRecord.measure(step, step, 1, prepared, None, wait_s=0.5, push_s=0.0),
                groups,
                prepared,
            )
        tracker.close()
    assert [r.getMessage() for r in caplog.records] == [
        "sample tables failed at step 1; off for the rest of the run"
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "r"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/reward_mean")] == [1, 2]
    assert "samples/text_summary" not in events.Tags()["tensors"]


def test_a_tracker_that_is_not_installed_stops_the_learner_at_start(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from learner import cli
    from learner.tracking import base
    from learner.tracking.config import TrackerKind

    # named fault: wandb's package name swapped for one that is not installed
    monkeypatch.setitem(base.PACKAGES, TrackerKind.WANDB, "wandb_not_installed")
    with caplog.at_level(logging.ERROR, logger="learner"):
        status = cli.main(["--model", str(tiny_model_dir), "--tracker", "tensorboard,wandb"])
    assert status == 2
    assert "--tracker needs wandb_not_installed: pip install 'rollout-farm[tracking]'" in (
        caplog.text
    )
