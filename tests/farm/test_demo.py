"""`farm demo`: the run ends once solved (or on the learner's last step) and leaves a curve,
the held-out score before and after training, and a summary.

The end-to-end test runs the real stack for a few learner steps (not the full
demo: the rise in reward is the demo's own output, measured in docs/farm.md);
the pure parts (history parsing, summary, plot) are checked on their own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from broker.connection import RedisSettings
from broker.keys import RunKeys
from farm import demo
from farm.app import FarmOutcome
from farm.demo import learner_history, summarize, write_outputs
from farm.stack import Stack
from learner.evaluation import EvalResult, report
from tests.cluster import LocalCluster

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _outcome(reason: str) -> FarmOutcome:
    stack = Stack((), "redis://127.0.0.1:1/0", (), Path("m"), Path("t"))
    return FarmOutcome(stack, reason, None, [])


def test_history_comes_from_the_learners_step_events(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_text(
        '2026-11-21 23:30:38,554 INFO learner {"event": "config", "model": "m"}\n'
        '2026-11-21 23:30:52,128 INFO learner {"event": "step", "step": 1, "reward_mean": 0.125}\n'
        "Traceback (most recent call last): not json {\n"
        '2026-11-21 23:30:54,628 INFO learner {"event": "step", "step": 2, "reward_mean": 0.5}\n'
    )
    assert learner_history(log) == [(1, 0.125, 0.0), (2, 0.5, 2.5)]
    assert learner_history(tmp_path / "missing.log") == []


def test_summary_and_outputs(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    rewards = [0.1, 0.0, 0.2, 0.3, 0.5, 0.6]
    log.write_text(
        "".join(
            f"2026-11-21 23:30:{10 + i:02d},000 INFO learner "
            f'{{"event": "step", "step": {i + 1}, "reward_mean": {r}}}\n'
            for i, r in enumerate(rewards)
        )
    )
    summary = summarize(_outcome("learner finished"), 12.34, log)
    assert summary["steps"] == 6
    assert summary["reward_window_steps"] == 2
    assert summary["reward_first"] == pytest.approx(0.05)
    assert summary["reward_last"] == pytest.approx(0.55)
    assert summary["reward_rise"] == pytest.approx(0.5)
    paths = write_outputs(tmp_path / "out", summary)
    assert [p.name for p in paths] == ["reward_curve.png", "summary.json", "summary.txt"]
    assert paths[0].read_bytes().startswith(PNG_MAGIC)
    assert json.loads(paths[1].read_text())["history"][-1] == {
        "step": 6,
        "reward": 0.6,
        "elapsed_s": 5.0,
    }
    text = paths[2].read_text()
    assert "rise               0.500" in text
    # 6 steps cannot hold a 10-step mean: no goal line (SmolLM2's demo trains 8 steps)
    assert "10-step mean" not in text


@pytest.mark.slow
def test_demo_runs_the_stack_to_the_last_step_and_scores_the_held_out_split_first_and_last(
    tmp_path: Path, tiny_model: Path
) -> None:
    """On `arith` (the tiny model's catch-all settings row), the learner scores the 20
    held-out problems before its first step and after its last, and the summary has both."""
    out = tmp_path / "demo"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "farm",
            "demo",
            "--work-dir",
            str(out),
            "--workers",
            "1",
            "--env",
            "arith",
            "--max-steps",
            "2",
            # the random model scores 0 on every sum: train on such groups all the same, with an
            # entropy bonus so that the gradient is not zero (a zero one is not a step)
            "--learner-arg=--no-skip-zero-variance",
            "--learner-arg=--entropy-coef=0.01",
            # the demo stops once solved: a 1-batch mean reward >= 0 held for 2 batches is
            # "solved" at the second batch, as a 0.95 10-batch mean would be on a solved toy
            "--solved-reward",
            "0",
            "--solved-mean-batches",
            "1",
            "--solved-window",
            "2",
            "--time-limit-s",
            "200",
            "--metrics-port",
            "0",
            "--model",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"].startswith("solved: the 1-batch mean reward"), summary
    assert summary["stop_reason"].endswith(">= 0 for 2 batches (step 2)")
    assert [h["step"] for h in summary["history"]] == [1, 2]  # two batches, both trained
    assert (out / "reward_curve.png").read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {out / 'reward_curve.png'}" in result.stdout
    assert "steps trained      2" in result.stdout
    assert "stopped because    solved: the 1-batch mean reward" in result.stdout
    before, after = summary["eval_before"], summary["eval_after"]
    assert (before["step"], after["step"], before["k"]) == (0, 2, 4), summary
    for scores in (before, after):
        assert scores["missing_rows"] == 0
        assert scores["sets"]["heldout/arith"]["scored_rows"] == 20
    assert summary["settings"]["row"] == "tiny/*"
    assert "held-out heldout  mean@4 " in result.stdout
    assert "settings           tiny/*: max steps 2, time limit 200 s" in result.stdout


@pytest.mark.slow
def test_demo_on_a_redis_cluster_with_three_partitions(
    tmp_path: Path, tiny_model: Path, redis_cluster: LocalCluster
) -> None:
    """`farm demo --redis-url redis+cluster://...` trains with tasks and trajectories spread
    over three partitions (three hash tags, so three slots of the cluster)."""
    redis_cluster.flush()
    out = tmp_path / "demo"
    argv = [
        sys.executable,
        "-m",
        "farm",
        "demo",
        "--work-dir",
        str(out),
        "--workers",
        "2",
        "--max-steps",
        "2",
        "--time-limit-s",
        "200",
        "--metrics-port",
        "0",
        "--model",
        str(tiny_model),
        "--sandbox-backend",
        "bwrap",
        "--run",
        "cdemo",
        "--redis-url",
        redis_cluster.url,
        "--partitions",
        "3",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "learner finished"
    assert [h["step"] for h in summary["history"]] == [1, 2]
    keys = RunKeys("cdemo", 3)
    client = RedisSettings.from_url(redis_cluster.url).client()

    async def read_counts() -> tuple[list[int], list[int]]:
        try:
            # issued: entries added (the learner trims what the workers acknowledged)
            tasks = [int((await client.xinfo_stream(s))["entries-added"]) for s in keys.all_tasks]
            read = []
            for stream in keys.all_trajectories:
                groups = await client.xinfo_groups(stream)
                read.append(sum(int(g["entries-read"] or 0) for g in groups))
            return tasks, read
        finally:
            await client.aclose()

    tasks, read = asyncio.run(read_counts())
    # The learner issues tasks round robin; at most 12 were issued before step 2 (8 admitted,
    # 4 more once step 1 released them), so no partition alone held the 8 groups trained.
    assert all(n > 0 for n in tasks), tasks
    assert sum(read) >= 8 and sum(1 for n in read if n) >= 2, read


def test_summary_says_when_the_ten_step_mean_first_reached_the_target(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    # steps 1-10 at 0.5, then 0.7, 0.7, 1.0: the 10-step mean is 0.52, 0.54, 0.59 (steps
    # 11-13), so it first reaches 0.6 at step 14 (0.64), the 14th line, 13 s after the first.
    rewards = [0.5] * 10 + [0.7, 0.7, 1.0, 1.0]
    log.write_text(
        "".join(
            f"2026-11-21 23:31:{10 + i:02d},000 INFO learner "
            f'{{"event": "step", "step": {i + 1}, "reward_mean": {r}}}\n'
            for i, r in enumerate(rewards)
        )
    )
    started = datetime(2026, 11, 21, 23, 30, 30)  # 40 s before the first step
    summary = summarize(_outcome("learner finished"), 60.0, log, started)
    assert (summary["target_reward"], summary["target_step"]) == (0.6, 14)
    assert summary["target_s"] == pytest.approx(40 + 13)
    assert (
        "reached at step 14, 53.0 s after start" in write_outputs(tmp_path, summary)[2].read_text()
    )
    log.write_text(log.read_text().replace('"reward_mean": 1.0', '"reward_mean": 0.6'))
    short = summarize(_outcome("learner finished"), 60.0, log, started)
    assert short["target_step"] is None and short["target_s"] is None
    assert "reward 0.6 (10-step mean) not reached" in write_outputs(tmp_path, short)[2].read_text()


def _eval_file(
    eval_dir: Path, step: int, mean: float, pass_k: float, *, multi: float = 0.0, env: str = "arith"
) -> None:
    """An eval-STEP.json as the learner writes it (`learner.evaluation.report`)."""
    figures = {"rows": 20.0, "scored_rows": 20.0, "mean_at_k": mean, "pass_at_1": mean / 2}
    figures |= {"pass_at_4": pass_k, "multi_turn": multi}
    sets = {"heldout": figures, f"heldout/{env}": figures}
    report(EvalResult(step, step, 3.0, 20, 0, (step, step), sets), eval_dir)


def test_summary_has_the_held_out_score_before_and_after_and_the_settings(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_text(
        "".join(
            f"2026-11-21 23:30:{10 + i:02d},000 INFO learner "
            f'{{"event": "step", "step": {i + 1}, "reward_mean": {r}}}\n'
            for i, r in enumerate([0.1, 0.3, 0.6])
        )
    )
    evals = tmp_path / "evals"
    _eval_file(evals, 0, 0.0625, 0.25)
    _eval_file(evals, 3, 0.65, 0.9)
    before, after = demo.eval_scores(evals)
    assert before == {
        "step": 0,
        "k": 4,
        "missing_rows": 0,
        "sets": {
            key: {
                "mean_at_k": 0.0625,
                "pass_at_1": 0.03125,
                "pass_at_k": 0.25,
                "multi_turn": 0.0,
                "scored_rows": 20,
                "infra_failed_rows": 0,
            }
            for key in ("heldout", "heldout/arith")
        },
    }
    assert after is not None and after["step"] == 3
    assert after["sets"]["heldout"]["pass_at_k"] == 0.9
    settings = {
        "model": "/m",
        "model_family": "smollm2",
        "env_spec": "arith",
        "row": "smollm2/arith",
        "measured": "seeds 0-2",
        "max_steps": 3,
        "time_limit_s": 480.0,
        "learner_args": ["--learning-rate", "2e-05"],
        "worker_args": ["--max-tokens", "12"],
    }
    summary = summarize(_outcome("learner finished"), 12.0, log)
    summary |= {"eval_before": before, "eval_after": after, "settings": settings}
    png, data, text = write_outputs(tmp_path / "out", summary)
    written = json.loads(data.read_text())
    assert written["eval_after"]["sets"]["heldout"]["mean_at_k"] == 0.65
    assert written["settings"]["learner_args"] == ["--learning-rate", "2e-05"]
    lines = text.read_text().splitlines()
    assert "held-out heldout  mean@4 0.062 -> 0.650, pass@4 0.250 -> 0.900" in lines
    assert "settings           smollm2/arith: max steps 3, time limit 480 s" in lines
    assert "  learner          --learning-rate 2e-05" in lines
    assert png.read_bytes().startswith(PNG_MAGIC)
    # the plot marks the set's score before (at step 0) and after (at its step)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        demo._mark_evals(ax, summary)
        marks = [(c.get_label(), c.get_offsets().tolist()) for c in ax.collections]
    finally:
        plt.close(fig)
    assert marks == [
        ("heldout mean@4 before: 0.06", [[0.0, 0.0625]]),
        ("heldout mean@4 after: 0.65", [[3.0, 0.65]]),
    ]


def test_summary_of_a_tool_environment_shows_its_calls_before_and_after(tmp_path: Path) -> None:
    """calc: an episode past its first turn is one that called the calculator."""
    evals = tmp_path / "evals"
    _eval_file(evals, 0, 0.14, 0.3, multi=0.25, env="calc")
    _eval_file(evals, 8, 0.5, 0.7, multi=0.8, env="calc")
    before, after = demo.eval_scores(evals)
    summary = summarize(_outcome("learner finished"), 12.0, tmp_path / "none.log")
    summary |= {"eval_before": before, "eval_after": after}
    _, _, text = write_outputs(tmp_path / "out", summary)
    line = (
        "held-out heldout  mean@4 0.140 -> 0.500, pass@4 0.300 -> 0.700, past turn 1 0.250 -> 0.800"
    )
    assert line in text.read_text().splitlines()


def test_an_evaluation_whose_rows_all_failed_on_the_infrastructure_is_no_score(
    tmp_path: Path,
) -> None:
    """Seen on calc: every eval episode timed out on the policy server; 0.000 would read as
    a model that unlearned."""
    evals = tmp_path / "evals"
    _eval_file(evals, 0, 0.14, 0.3, multi=0.25, env="calc")
    failed = {"rows": 40.0, "scored_rows": 0.0, "infra_failed_rows": 40.0, "mean_at_k": 0.0}
    failed |= {"pass_at_1": 0.0, "pass_at_4": 0.0, "multi_turn": 0.0}
    sets = {"heldout": failed, "heldout/calc": failed}
    report(EvalResult(5, 5, 3.0, 40, 0, (5, 5), sets), evals)
    before, after = demo.eval_scores(evals)
    summary = summarize(_outcome("learner finished"), 12.0, tmp_path / "none.log")
    summary |= {"eval_before": before, "eval_after": after}
    _, _, text = write_outputs(tmp_path / "out", summary)
    lines = text.read_text().splitlines()
    assert "held-out heldout  mean@4 0.140 -> -, pass@4 0.300 -> -, past turn 1 0.250 -> -" in lines
    assert any(line.startswith("  after: 40 rows left out, failed on the infra") for line in lines)


def test_summary_says_when_the_run_ended_before_its_last_evaluation(tmp_path: Path) -> None:
    _eval_file(tmp_path / "evals", 0, 0.0625, 0.25)
    before, after = demo.eval_scores(tmp_path / "evals")
    summary = summarize(_outcome("time limit of 480s reached"), 480.0, tmp_path / "none.log")
    summary |= {"eval_before": before, "eval_after": after}
    text = write_outputs(tmp_path, summary)[2].read_text()
    assert "held-out heldout  mean@4 0.062 -> -, pass@4 0.250 -> -" in text
    assert "held-out score at the end: none (the run stopped before its last step)" in text
    assert demo.eval_scores(None) == (None, None)
