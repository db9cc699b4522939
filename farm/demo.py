"""`farm demo`: train the toy environment on CPU, then plot the reward curve.

The demo runs the whole local stack (private Redis, CPU policy server with the
tiny model, workers, learner) in a fresh run directory, with settings a 2-core
machine trains visibly within its time limit, and stops when the toy is solved (the
learner's ``--stop-when-solved``: a 10-batch mean reward of 0.95 or more held for 20
batches), the learner reaches `max_steps`, or the time limit passes. It then writes,
into the run directory:

    reward_curve.png   learner reward (batch mean) per optimizer step (matplotlib, Agg)
    summary.json       steps, first/last rewards, the rise, wall time, stop reason
    summary.txt        the same for humans

and prints where they are. matplotlib is imported only here, after the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from farm.app import FarmOutcome

# Settings the toy task learns with on two CPU cores within a few minutes: 16 prompts x 8
# samples a step, lr 3e-3 after a 10-step warm-up. In-process (tests/learner/inprocess.py),
# seeds 0-2 reached a 10-step mean of 0.6 at steps 55, 51 and 57; 4 prompts a step took
# 200+ steps or stalled, and lr 5e-3 or 1e-2 collapsed onto wrong answers on one seed of three.
DEMO_LEARNER_ARGS = [
    "--group-size",
    "8",
    "--groups-per-batch",
    "16",
    "--learning-rate",
    "3e-3",
    "--lr-warmup-steps",
    "10",
    "--max-staleness",
    "1",
    "--checkpoint-interval",
    "1000",
]
# Added per environment. lookup must copy the tool's answer from its second turn: an entropy
# bonus and an lr decayed over the run keep it from collapsing on a wrong digit first
# (in-process, seeds 0-2: last 10-step mean 0.94, 0.92, 0.69 after 250 steps; see
# tests/learner/test_learning.py).
ENV_LEARNER_ARGS = {
    "lookup": [
        "--entropy-coef",
        "0.03",
        "--lr-schedule",
        "cosine",
        "--lr-decay-steps",
        "250",
        "--min-lr-ratio",
        "0.1",
    ],
}
DEMO_MAX_STEPS, DEMO_TIME_LIMIT_S = 500, 270.0
# The demo's goal: the mean reward of 10 consecutive steps reaching this (its summary says when).
TARGET_REWARD = 0.6
# One token: the toy answer is one digit, and the worker restricts sampling to digits.
DEMO_WORKER_ARGS = ["--max-tokens", "1", "--temperature", "1.0"]


def learner_args(env_spec: str) -> list[str]:
    """The demo's learner settings for `env_spec` (name@kwargs), before the user's own."""
    return [*DEMO_LEARNER_ARGS, *ENV_LEARNER_ARGS.get(env_spec.partition("@")[0], [])]


def default_output_dir() -> Path:
    return Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")


def learner_events(log: Path, kind: str) -> Iterator[tuple[datetime, dict[str, Any]]]:
    """(time stamp, event) of each ``{"event": kind, ...}`` line of the learner's log."""
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        start = line.find("{")
        try:
            event = json.loads(line[start:]) if start >= 0 else None
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == kind:
            yield stamp, event


def learner_history(log: Path, origin: datetime | None = None) -> list[tuple[int, float, float]]:
    """(step, reward, seconds since `origin`) from the learner's step events.

    The learner logs one JSON object per optimizer step (``"event": "step"``), so the
    curve has every step, where polling /metrics would see only some of them. Without
    an `origin` (a local-time datetime, as the log's stamps are), seconds count from
    the first step.
    """
    history: list[tuple[int, float, float]] = []
    first: datetime | None = origin
    for stamp, event in learner_events(log, "step"):
        first = first or stamp
        step, reward = int(event["step"]), float(event["reward_mean"])
        history.append((step, reward, (stamp - first).total_seconds()))
    return history


def stop_reason(outcome: FarmOutcome, log: Path) -> str:
    """Why the farm stopped: the learner's own reason when it ended a solved run
    (``--stop-when-solved``), else the supervisor's."""
    solved = [event for _, event in learner_events(log, "solved")]
    if outcome.stop_reason == "learner finished" and solved:
        return str(solved[-1]["reason"])
    return outcome.stop_reason


def time_to_target(
    history: list[tuple[int, float, float]], target: float = TARGET_REWARD, window: int = 10
) -> tuple[int, float] | None:
    """(step, seconds) of the first step whose last-`window` mean reward reaches `target`."""
    for i in range(window - 1, len(history)):
        if sum(r for _, r, _ in history[i - window + 1 : i + 1]) / window >= target:
            return history[i][0], history[i][2]
    return None


def summarize(
    outcome: FarmOutcome, wall_s: float, log: Path, started: datetime | None = None
) -> dict[str, Any]:
    """The demo's numbers; `started` (local time) is when the demo began, for the target time."""
    history = learner_history(log) or outcome.reward_history
    rewards = [r for _, r, _ in history]
    hit = time_to_target(learner_history(log, started) if started else history)
    window = max(1, min(10, len(rewards) // 3))
    first = sum(rewards[:window]) / window if rewards else None
    last = sum(rewards[-window:]) / window if rewards else None
    status = outcome.last_status
    return {
        "steps": history[-1][0] if history else 0,
        "reward_first": first,
        "reward_last": last,
        "reward_rise": None if first is None or last is None else last - first,
        "reward_window_steps": window,
        "episodes_per_s": status.episodes_per_s if status else None,
        "wall_s": round(wall_s, 1),
        "target_reward": TARGET_REWARD,
        "target_step": hit[0] if hit else None,
        "target_s": round(hit[1], 1) if hit else None,
        "stop_reason": stop_reason(outcome, log),
        "history": [{"step": s, "reward": r, "elapsed_s": round(t, 1)} for s, r, t in history],
    }


def write_outputs(out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "reward_curve.png"
    _plot(png, summary["history"])
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = out_dir / "summary.txt"
    text.write_text(_text(summary))
    return [png, out_dir / "summary.json", text]


def _plot(path: Path, history: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        steps = [h["step"] for h in history]
        rewards = [h["reward"] for h in history]
        ax.plot(steps, rewards, marker="o", ms=2, lw=0.8, alpha=0.6, label="per step")
        window = 10
        if len(rewards) >= window:
            smooth = [
                sum(rewards[i - window : i]) / window for i in range(window, len(rewards) + 1)
            ]
            ax.plot(steps[window - 1 :], smooth, lw=2, label=f"mean of {window} steps")
        ax.legend(loc="upper left")
        ax.set_xlabel("learner step")
        ax.set_ylabel("mean reward of the batch")
        ax.set_title("farm demo: tiny model on CPU")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _target(summary: dict[str, Any]) -> str:
    if summary["target_s"] is None:
        return "not reached"
    return f"reached at step {summary['target_step']}, {summary['target_s']} s after start"


def _text(summary: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (
        f"steps trained      {summary['steps']}\n"
        f"reward, first {summary['reward_window_steps']} steps  {f(summary['reward_first'])}\n"
        f"reward, last {summary['reward_window_steps']} steps   {f(summary['reward_last'])}\n"
        f"rise               {f(summary['reward_rise'])}\n"
        f"reward {summary['target_reward']} (10-step mean) {_target(summary)}\n"
        f"wall time          {summary['wall_s']} s\n"
        f"stopped because    {summary['stop_reason']}\n"
    )
