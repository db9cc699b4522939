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
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from farm.app import FarmOutcome

# The demo's goal: the mean reward of 10 consecutive steps reaching this (its summary says when).
TARGET_REWARD = 0.6


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


def eval_scores(eval_dir: Path | None) -> tuple[dict | None, dict | None]:
    """The held-out scores (the learner's ``eval-STEP.json`` in `eval_dir`) before training
    (step 0) and at the end (the last step evaluated after it); None where there is none."""
    files = sorted(eval_dir.glob("eval-*.json")) if eval_dir and eval_dir.is_dir() else []
    results = [json.loads(f.read_text()) for f in files]
    before = next((_scores(r) for r in results if r["step"] == 0), None)
    after = [_scores(r) for r in results if r["step"] > 0]
    return before, after[-1] if after else None


def _scores(result: dict[str, Any]) -> dict[str, Any]:
    """mean@k and pass@k per set (and set/env) of one eval result; k is read off its
    ``pass_at_K`` figure, so an --eval-samples of the user's own is reported as run."""
    figures = next(iter(result["sets"].values()), {})
    k = max((int(key[8:]) for key in figures if key.startswith("pass_at_")), default=1)
    sets = {
        key: {
            "mean_at_k": figures["mean_at_k"],
            "pass_at_1": figures["pass_at_1"],
            "pass_at_k": figures[f"pass_at_{k}"],
            "multi_turn": figures.get("multi_turn"),
            "scored_rows": int(figures["scored_rows"]),
            "infra_failed_rows": int(figures.get("infra_failed_rows", 0)),
        }
        for key, figures in result["sets"].items()
    }
    return {"step": result["step"], "k": k, "missing_rows": result["missing_rows"], "sets": sets}


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
    _plot(png, summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = out_dir / "summary.txt"
    text.write_text(_text(summary))
    return [png, out_dir / "summary.json", text]


def _plot(path: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = summary["history"]
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
        _mark_evals(ax, summary)
        ax.margins(y=0.15)  # room for the marks' labels
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(loc="upper left")
        ax.set_xlabel("learner step")
        ax.set_ylabel("mean reward of the batch")
        row = summary.get("settings", {}).get("row", "tiny model")
        ax.set_title(f"farm demo: {row} on CPU")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _mark_evals(ax: Any, summary: dict[str, Any]) -> None:
    """The held-out mean@k before (at its step, 0) and after training, as labelled points."""
    for when, color in (("eval_before", "tab:red"), ("eval_after", "tab:green")):
        result = summary.get(when)
        for name, figures in (result or {}).get("sets", {}).items():
            if "/" in name:  # the per-environment figures repeat a one-environment set's
                continue
            score = figures["mean_at_k"]
            label = f"{name} mean@{result['k']} {when[5:]}: {score:.2f}"
            ax.scatter([result["step"]], [score], s=80, marker="D", color=color, label=label)
            ax.annotate(
                f"{score:.2f}",
                (result["step"], score),
                textcoords="offset points",
                xytext=(6, 6),
                color=color,
            )


def _target_line(summary: dict[str, Any]) -> str:
    """The 10-step-mean goal, for a run long enough to have one (not SmolLM2's 8 steps)."""
    if summary["target_s"] is not None:
        reached = f"reached at step {summary['target_step']}, {summary['target_s']} s after start"
    elif summary["steps"] >= 10:
        reached = "not reached"
    else:
        return ""
    return f"reward {summary['target_reward']} (10-step mean) {reached}\n"


def _text(summary: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    return (
        f"steps trained      {summary['steps']}\n"
        f"reward, first {summary['reward_window_steps']} steps  {f(summary['reward_first'])}\n"
        f"reward, last {summary['reward_window_steps']} steps   {f(summary['reward_last'])}\n"
        f"rise               {f(summary['reward_rise'])}\n"
        + _target_line(summary)
        + f"wall time          {summary['wall_s']} s\n"
        f"stopped because    {summary['stop_reason']}\n"
        + "".join(_eval_lines(summary))
        + "".join(_settings_lines(summary.get("settings")))
    )


def _eval_lines(summary: dict[str, Any]) -> list[str]:
    """One line per held-out set: mean@k and pass@k before and after training."""
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before is None and after is None:
        return []
    names = sorted({*(before or {}).get("sets", {}), *(after or {}).get("sets", {})})
    k = (before or after or {})["k"]
    lines = []
    for name in (n for n in names if "/" not in n):

        def fig(result: dict | None, metric: str, name: str = name) -> str:
            figures = _set_figures(result, name)
            if figures.get(metric) is None or figures.get("scored_rows") == 0:
                return "-"  # no score: not run, or every row failed on the infrastructure
            return f"{figures[metric]:.3f}"

        line = (
            f"held-out {name}  mean@{k} {fig(before, 'mean_at_k')} -> {fig(after, 'mean_at_k')}, "
            f"pass@{k} {fig(before, 'pass_at_k')} -> {fig(after, 'pass_at_k')}"
        )
        multi = fig(before, "multi_turn"), fig(after, "multi_turn")
        if any(m not in ("-", "0.000") for m in multi):  # a tool environment: calls made
            line += f", past turn 1 {multi[0]} -> {multi[1]}"
        lines.append(line + "\n")
        for when, result in (("before", before), ("after", after)):
            figures = _set_figures(result, name)
            if figures.get("infra_failed_rows"):
                lines.append(
                    f"  {when}: {figures['infra_failed_rows']} rows left out, failed on the "
                    "infrastructure (the workers' logs say why)\n"
                )
    if after is None:
        lines.append("held-out score at the end: none (the run stopped before its last step)\n")
    return lines


def _set_figures(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """One set's figures of an `eval_scores` result ({} when there is no result or set)."""
    return (result or {}).get("sets", {}).get(name) or {}


def _settings_lines(settings: dict[str, Any] | None) -> list[str]:
    if not settings:
        return []
    return [
        f"model              {settings['model']} ({settings['model_family']})\n",
        f"environment        {settings['env_spec']}"
        + (f" (sandbox {sandbox})\n" if (sandbox := settings.get("sandbox_backend")) else "\n"),
        f"settings           {settings['row']}: max steps {settings['max_steps']}, "
        f"time limit {settings['time_limit_s']:.0f} s\n",
        f"  learner          {' '.join(settings['learner_args'])}\n",
        f"  workers          {' '.join(settings['worker_args'])}\n",
        f"  measured by      {settings['measured']}\n",
    ]
