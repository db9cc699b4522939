"""End-to-end benchmark against TRL: time and samples to reach a mean training reward.

Two systems train the same model on the same task with the same batch, learning rate,
completion length and sampling (`bench._e2e_setups`):

- default, the toy: the tiny model (built once per run, same seed) on `toy` (copy a digit,
  ~10% by chance), group size 8, 16 groups per step, lr 3e-3 after a 10-step linear warm-up
  (the toy demo's settings), one completion token restricted to the digits and stop tokens;
  target a 10-step mean of 0.4;
- `--model smollm2`: SmolLM2-135M-Instruct (`inference.models`, converted once and cached,
  before any clock starts) on `arith`'s train split with the row of `farm demo --model
  smollm2` (`farm.demo_settings`: group size 8, 4 groups per step, lr 2e-5 constant,
  micro-batches of 8, 12 completion tokens, temperature 1, on policy, no KL); target a
  3-step mean of 0.5 within 12 steps (why 0.5 and 3 steps: `bench._e2e_setups`). The TRL
  side sees the observation through the model's chat template exactly as a worker renders
  it, and scores with the `arith` environment's own reward.

The two systems:

- this farm: `farm up` with its defaults (private Redis, the CPU policy server, two
  workers, the learner), plus those settings;
- TRL's `GRPOTrainer` (`bench/_trl_grpo.py`), run in the benchmark's own venv,
  layered over the project venv (a `.pth` file naming its site-packages) so torch
  and transformers are the project's; it is created on first use, with pip
  constrained to the installed torch and transformers versions so that no other
  torch is ever pulled.

For each, the clock starts when its process is launched (start-up counts) and stops
at the first optimizer step where the mean reward of the last `--window` steps
reaches `--target`; samples = steps x group size x groups per step. The table splits
that time at the first optimizer step (start-up, then training) and gives the seconds
per optimizer step after the first, so a run that misses the target still compares the
pace. The systems run one after the other, alternating which goes first, `--runs` times;
medians are printed with the ratio farm / TRL (goal: <= 0.5).
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
from bench._e2e_setups import MODELS, Setup, smollm2_setup, toy_setup
from farm.demo import learner_history, time_to_target
from launch.settings import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
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


def run_farm(setup: Setup, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`farm up` (defaults plus the setup's flags) until the target or the budget."""
    argv = [
        sys.executable,
        "-m",
        "farm",
        "up",
        "--work-dir",
        str(work),
        "--model",
        str(setup.model),
        "--metrics-port",
        "0",
        "--quiet",
        "--max-steps",
        str(setup.max_steps),
        *(("--workers", "1") if args.smoke else ()),  # one process less to start (CI)
        *setup.farm_args,
        f"--learner-arg=--seed={args.seed}",
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
                lambda: time_to_target(learner_history(log, origin), setup.target, setup.window),
                deadline,
            )
        finally:
            _stop(proc)
    return _result("farm", setup, hit, learner_history(log, origin))


def run_trl(python: Path, setup: Setup, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in its venv, until the target or the budget."""
    settings = work / "settings.json"
    work.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(setup.trl_settings(args.seed)))
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
                proc, lambda: time_to_target(history(), setup.target, setup.window), deadline
            )
        finally:
            _stop(proc)
    if not history():
        raise RuntimeError(f"TRL produced no step: {out_path.read_text(errors='replace')[-2000:]}")
    return _result("trl", setup, hit, history())


def _result(
    system: str, setup: Setup, hit: Any, history: list[tuple[int, float, float]]
) -> dict[str, Any]:
    steps, seconds = hit if hit else (None, None)
    first, last = (history[0], history[-1]) if history else (None, None)
    return {
        "system": system,
        "reached": hit is not None,
        "seconds": seconds,
        "steps": steps,
        "samples": steps * setup.samples_per_step if steps else None,
        "steps_run": len(history),
        "last_reward": last[1] if last else None,
        # start-up (launch to the first optimizer step) against the training after it
        "first_step_s": first[2] if first else None,
        "after_first_step_s": seconds - first[2] if hit and first else None,
        # the steady pace: seconds per optimizer step after the first, over the steps run
        "s_per_step": (last[2] - first[2]) / (len(history) - 1) if len(history) > 1 else None,
        "rewards": [round(r, 4) for _, r, _ in history],
    }


def _median(rows: list[dict[str, Any]], key: str, reached_only: bool = True) -> float | None:
    values = [r[key] for r in rows if (r["reached"] or not reached_only) and r[key] is not None]
    return statistics.median(values) if len(values) == len(rows) and values else None


MEASURES = (  # (key, label, a median over reached runs only)
    ("seconds", "wall time to target s", True),
    ("first_step_s", "  launch to 1st step s", True),
    ("after_first_step_s", "  1st step to target s", True),
    ("samples", "samples to target", True),
    ("s_per_step", "s per step after 1st", False),
)


def _table(results: list[dict[str, Any]], setup: Setup) -> str:
    farm = [r for r in results if r["system"] == "farm"]
    trl = [r for r in results if r["system"] == "trl"]
    lines = [
        f"target: mean reward of the last {setup.window} steps >= {setup.target} "
        f"(at most {setup.max_steps} steps); {setup.describe()}; {len(farm)} run(s), medians",
        f"{'measure':<22} {'farm':>10} {'trl':>10} {'farm/trl':>9}",
    ]
    for key, label, reached_only in MEASURES:
        f, t = _median(farm, key, reached_only), _median(trl, key, reached_only)
        ratio = f"{f / t:9.2f}" if f is not None and t else f"{'-':>9}"
        fs = f"{f:10.1f}" if f is not None else f"{'not all':>10}"
        ts = f"{t:10.1f}" if t is not None else f"{'not all' if trl else 'not run':>10}"
        lines.append(f"{label:<22} {fs} {ts} {ratio}")
    for r in results:
        lines.append(
            f"  {r['system']:<5} reached={r['reached']} seconds={r['seconds'] and round(r['seconds'], 1)}"
            f" steps={r['steps']} steps_run={r['steps_run']} rewards={r['rewards']}"
        )
    lines.append("(wall time from process launch, start-up included; goal farm/trl <= 0.5)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench e2e",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="train arith with this real model and its demo settings (none: the toy, tiny model)",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each system (median)")
    parser.add_argument("--target", type=float, help="mean reward to reach (toy 0.4, arith 0.5)")
    parser.add_argument("--window", type=int, help="steps in the reward mean (toy 10, arith 3)")
    parser.add_argument(
        "--learning-rate", type=float, help="both systems' lr (toy 3e-3, arith 2e-5)"
    )
    parser.add_argument("--max-steps", type=int, help="steps before giving up (toy 400, arith 12)")
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
        help="one farm run of 2 steps with one worker, no TRL (CI: no venv build); toy only",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (the table to stderr)")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the systems to run; a bad combination exits with argparse's error."""
    parser = _parser()
    args = parser.parse_args(argv)
    systems = (args.systems or ("farm" if args.smoke else "farm,trl")).split(",")
    if unknown := set(systems) - {"farm", "trl"}:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from farm, trl")
    if args.smoke and args.model:
        parser.error("--smoke runs the toy only (a SmolLM2 farm takes minutes); drop --model")
    if args.runs < 1:
        parser.error("--runs: at least 1")
    if args.smoke:
        args.max_steps, args.budget_s = 2, 120.0
    return args, systems


def _setup(args: argparse.Namespace, tmp: Path) -> Setup:
    """The run's setup, its model built (the toy's tiny one) or taken from the model cache."""
    if args.model is None:
        from inference.tiny import build_tiny_model

        return toy_setup(args, build_tiny_model(tmp / "model", seed=args.seed))
    from inference.models import ModelUnavailable, ensure_model

    try:
        return smollm2_setup(args, ensure_model(args.model))
    except ModelUnavailable as exc:
        raise SystemExit(f"bench e2e: --model {args.model}: {exc}") from None


def main(argv: list[str]) -> int:
    args, systems = parse(argv)
    started = report.start("e2e", argv)
    runs = 1 if args.quick or args.smoke else args.runs
    python = ensure_trl_venv(args.trl_venv) if "trl" in systems else None
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        setup = _setup(args, Path(tmp))
        for i in range(runs):
            order = ("farm", "trl") if i % 2 == 0 else ("trl", "farm")
            for system in (s for s in order if s in systems):
                work = Path(tmp) / f"{system}-{i}"
                row = (
                    run_trl(python, setup, work, args)
                    if python is not None and system == "trl"
                    else run_farm(setup, work, args)
                )
                print(json.dumps(row), file=sys.stderr, flush=True)
                results.append(row)
    return report.emit(started, results, _table(results, setup), args.json)
