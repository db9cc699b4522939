"""End-to-end benchmark against TRL: time and samples to reach a mean reward on the toy task.

Two systems train the same tiny model (built once per run, same seed) on `toy`
(copy a digit, ~10% by chance) with the same group size (8), groups per step (16),
learning rate and 10-step linear warm-up (the demo's settings), one completion token
restricted to the digits and stop tokens:

- this farm: `farm up` with its defaults (private Redis, the CPU policy server, two
  workers, the learner), plus those settings and `--max-tokens 1`;
- TRL's `GRPOTrainer` (`bench/_trl_grpo.py`), run in the benchmark's own venv,
  layered over the project venv (a `.pth` file naming its site-packages) so torch
  and transformers are the project's; it is created on first use, with pip
  constrained to the installed torch and transformers versions so that no other
  torch is ever pulled.

For each, the clock starts when its process is launched (start-up counts) and stops
at the first optimizer step where the mean reward of the last `--window` steps
reaches `--target`; samples = steps x group size x groups per step. The systems run
one after the other, alternating which goes first, `--runs` times; medians are
printed with the ratio farm / TRL (goal: <= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import _report as report
from farm.demo import learner_history, time_to_target
from launch.settings import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE, GROUPS_PER_BATCH, WARMUP_STEPS = 8, 16, 10
DEFAULT_TRL_VENV = ROOT / ".bench" / "trl-venv"


def ensure_trl_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing TRL into it when missing."""
    python = venv / "bin" / "python"
    if python.exists() and _run_ok([str(python), "-c", "import trl"]):
        return python
    import torch
    import transformers

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Layer the venv over this one (a .pth file), so pip finds torch and transformers
    # installed; `--system-site-packages` would reach the base interpreter's instead.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "rollout_farm_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    constraints = venv / "constraints.txt"
    constraints.write_text(
        f"torch=={torch.__version__.split('+')[0]}\ntransformers=={transformers.__version__}\n"
    )
    print(f"installing trl into {venv} (torch and transformers pinned) ...", flush=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), "trl"], check=True
    )
    return python


def _run_ok(argv: list[str]) -> bool:
    return subprocess.run(argv, capture_output=True).returncode == 0


def _wait_for(proc: subprocess.Popen[bytes], poll: Callable[[], Any], deadline: float) -> Any:
    while time.monotonic() < deadline and proc.poll() is None:
        if (hit := poll()) is not None:
            return hit
        time.sleep(0.5)
    return poll()


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_farm(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`farm up` (defaults) until the target is reached or the budget runs out."""

    learner_args = [
        "--group-size",
        str(GROUP_SIZE),
        "--groups-per-batch",
        str(GROUPS_PER_BATCH),
        "--learning-rate",
        str(args.learning_rate),
        "--lr-warmup-steps",
        str(WARMUP_STEPS),
        "--seed",
        str(args.seed),
    ]
    argv = [
        sys.executable,
        "-m",
        "farm",
        "up",
        "--work-dir",
        str(work),
        "--model",
        str(model),
        "--metrics-port",
        "0",
        "--quiet",
        "--max-steps",
        str(args.max_steps),
        *(("--workers", "1") if args.smoke else ()),  # one process less to start (CI)
        *(f"--learner-arg={a}" for a in learner_args),
        "--worker-arg=--max-tokens",
        "--worker-arg=1",
    ]
    origin = datetime.now()
    log = work / "logs" / "learner.log"
    with (work.parent / f"{work.name}.out").open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + args.budget_s
            hit = _wait_for(
                proc,
                lambda: time_to_target(learner_history(log, origin), args.target, args.window),
                deadline,
            )
        finally:
            _stop(proc)
    return _result("farm", hit, learner_history(log, origin))


def run_trl(python: Path, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in its venv, until the target or the budget."""
    settings = work / "settings.json"
    work.mkdir(parents=True, exist_ok=True)
    settings.write_text(
        json.dumps(
            {
                "model": str(model),
                "learning_rate": args.learning_rate,
                "group_size": GROUP_SIZE,
                "groups_per_batch": GROUPS_PER_BATCH,
                "warmup_steps": WARMUP_STEPS,
                "max_steps": args.max_steps,
                "window": args.window,
                "target": args.target,
                "seed": args.seed,
            }
        )
    )
    out_path = work / "trl.out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    origin = time.time()
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "bench._trl_grpo", str(settings)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

        def history() -> list[tuple[int, float, float]]:
            rows = []
            for line in out_path.read_text(errors="replace").splitlines():
                if line.startswith('{"step"'):
                    e = json.loads(line)
                    rows.append((int(e["step"]), float(e["reward"]), float(e["t"]) - origin))
            return rows

        try:
            deadline = time.monotonic() + args.budget_s
            hit = _wait_for(
                proc, lambda: time_to_target(history(), args.target, args.window), deadline
            )
        finally:
            _stop(proc)
    if not history():
        raise RuntimeError(f"TRL produced no step: {out_path.read_text(errors='replace')[-2000:]}")
    return _result("trl", hit, history())


def _result(system: str, hit: Any, history: list[tuple[int, float, float]]) -> dict[str, Any]:
    steps, seconds = hit if hit else (None, None)
    per_step = GROUP_SIZE * GROUPS_PER_BATCH
    return {
        "system": system,
        "reached": hit is not None,
        "seconds": seconds,
        "steps": steps,
        "samples": steps * per_step if steps else None,
        "steps_run": len(history),
        "last_reward": history[-1][1] if history else None,
        # start-up (launch to the first optimizer step) against the training after it
        "first_step_s": history[0][2] if history else None,
        "after_first_step_s": seconds - history[0][2] if hit and history else None,
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r["reached"]]
    return statistics.median(values) if len(values) == len(rows) and values else None


def _table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    farm = [r for r in results if r["system"] == "farm"]
    trl = [r for r in results if r["system"] == "trl"]
    lines = [
        f"target: mean reward of the last {args.window} steps >= {args.target}; "
        f"group size {GROUP_SIZE}, {GROUPS_PER_BATCH} groups/step, "
        f"lr {args.learning_rate} after {WARMUP_STEPS} warm-up steps; "
        f"{len(farm)} run(s), medians",
        f"{'measure':<22} {'farm':>10} {'trl':>10} {'farm/trl':>9}",
    ]
    for key, label in (
        ("seconds", "wall time to target s"),
        ("first_step_s", "  launch to 1st step s"),
        ("after_first_step_s", "  1st step to target s"),
        ("samples", "samples to target"),
    ):
        f, t = _median(farm, key), _median(trl, key)
        ratio = f"{f / t:9.2f}" if f is not None and t else f"{'-':>9}"
        fs = f"{f:10.1f}" if f is not None else f"{'not all':>10}"
        ts = f"{t:10.1f}" if t is not None else f"{'not all' if trl else 'not run':>10}"
        lines.append(f"{label:<22} {fs} {ts} {ratio}")
    for r in results:
        lines.append(
            f"  {r['system']:<5} reached={r['reached']} seconds={r['seconds'] and round(r['seconds'], 1)}"
            f" steps={r['steps']} steps_run={r['steps_run']}"
        )
    lines.append("(wall time from process launch, start-up included; goal farm/trl <= 0.5)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench e2e",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each system (median)")
    parser.add_argument("--target", type=float, default=0.4, help="mean reward to reach")
    parser.add_argument("--window", type=int, default=10, help="steps in the reward mean")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="both systems' lr")
    parser.add_argument("--max-steps", type=int, default=400, help="steps before giving up")
    parser.add_argument("--budget-s", type=float, default=900.0, help="seconds before giving up")
    parser.add_argument("--seed", type=int, default=0, help="model and sampling seed")
    parser.add_argument("--trl-venv", type=Path, default=DEFAULT_TRL_VENV, help="TRL's venv")
    parser.add_argument(
        "--systems", default=None, help="comma-separated, of farm,trl (default both; smoke: farm)"
    )
    parser.add_argument("--quick", action="store_true", help="one run of each")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one farm run of 2 steps with one worker, no TRL (CI: no venv build)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    args = parser.parse_args(argv)
    started = report.start("e2e", argv)
    systems = (args.systems or ("farm" if args.smoke else "farm,trl")).split(",")
    if unknown := set(systems) - {"farm", "trl"}:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from farm, trl")
    if args.smoke:
        args.max_steps, args.budget_s = 2, 120.0
    runs = 1 if args.quick or args.smoke else args.runs
    python = ensure_trl_venv(args.trl_venv) if "trl" in systems else None
    from inference.tiny import build_tiny_model

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=args.seed)
        for i in range(runs):
            order = ("farm", "trl") if i % 2 == 0 else ("trl", "farm")
            for system in (s for s in order if s in systems):
                work = Path(tmp) / f"{system}-{i}"
                row = (
                    run_trl(python, model, work, args)
                    if python is not None and system == "trl"
                    else run_farm(model, work, args)
                )
                print(json.dumps(row), file=sys.stderr, flush=True)
                results.append(row)
    return report.emit(started, results, _table(results, args), args.json)
