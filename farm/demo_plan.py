"""What one `farm demo` run trains, and with which settings, before anything starts.

`plan_demo` resolves the model (a name of `inference.models`, such as ``smollm2``, is
converted once and cached; a directory is used as it is; none builds the tiny model), its
family, the environment (the family's own when none is given: ``arith`` for SmolLM2) and the
settings row of `farm.demo_settings`, and returns the `FarmConfig` the demo runs: the row's
environment settings and sandbox unless given, its learner and worker flags first (the user's
--learner-arg/--worker-arg follow and win), its step limit and stop rule unless given, and,
for an environment with a held-out split, a task file listing each held-out problem once
(`<work_dir>/heldout.jsonl`) scored by the learner before the first step and after the last
(`<work_dir>/evals/eval-STEP.json`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm import demo_settings as table
from farm.config import FarmConfig, load_config
from farm.errors import ConfigError, StartupError

FAMILY_ENVS = {"smollm2": "arith"}  # a family's environment when --env is not given


@dataclass(frozen=True)
class DemoPlan:
    """The resolved run: its config, the settings row and where the held-out scores go."""

    cfg: FarmConfig
    family: str
    row_name: str
    row: table.DemoSettings
    time_limit_s: float
    eval_dir: Path | None  # None: the environment has no held-out split

    def settings(self) -> dict[str, Any]:
        """The settings the run used, for the summary."""
        row = self.row
        return {
            "model": str(self.cfg.model) if self.cfg.model else "tiny (built in the run dir)",
            "model_family": self.family,
            "env_spec": self.cfg.env_spec,
            "sandbox_backend": self.cfg.sandbox_backend,
            "row": self.row_name,
            "measured": row.measured,
            "max_steps": self.cfg.max_steps,
            "time_limit_s": self.time_limit_s,
            "stop_when_solved": self.cfg.progress.stop_when_solved,
            "eval_samples": row.eval_samples if self.eval_dir else None,
            "learner_args": list(self.cfg.learner_args),
            "worker_args": list(self.cfg.worker_args),
        }


def plan_demo(
    toml: Path | None, cli: dict[str, Any], time_limit_s: float | None, say: Callable[[str], None]
) -> DemoPlan:
    """The demo's config from the user's flags (`cli`: flat names, None unset) and TOML;
    blocking (a model conversion takes a minute), so the CLI runs it in a thread."""
    cli = dict(cli)
    cli["work_dir"] = cli["work_dir"] or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    given = load_config(toml, **cli)
    model = resolve_model(given.model, say)
    family = table.model_family(model)
    env_spec = given.env_spec
    if "env_spec" not in given.model_fields_set:
        env_spec = FAMILY_ENVS.get(family, env_spec)
    row_name, row = table.lookup(family, env_spec.partition("@")[0])
    cli |= {"model": model, "env_spec": table.env_spec_of(row, env_spec)}
    if "max_steps" not in given.model_fields_set:
        cli["max_steps"] = row.max_steps
    if "sandbox_backend" not in given.model_fields_set and row.sandbox_backend:
        cli["sandbox_backend"] = row.sandbox_backend
    if cli.get("stop_when_solved") is None:
        cli["stop_when_solved"] = row.stop_when_solved
    cfg = load_config(toml, **cli)
    learner = [*table.learner_args(row)]
    heldout = table.heldout_lines(cfg.env_spec)
    eval_dir = None
    if heldout is not None:
        work = cfg.work_dir.resolve()
        work.mkdir(parents=True, exist_ok=True)
        (tasks := work / "heldout.jsonl").write_text("\n".join(heldout) + "\n")
        eval_dir = work / "evals"
        learner += table.eval_args(row, tasks, eval_dir, cfg.max_steps)
    cfg = cfg.model_copy(
        update={
            "learner_args": [*learner, *cfg.learner_args],
            "worker_args": [*table.worker_args(row), *cfg.worker_args],
        }
    )
    return DemoPlan(cfg, family, row_name, row, time_limit_s or row.time_limit_s, eval_dir)


def resolve_model(model: Path | None, say: Callable[[str], None]) -> Path | None:
    """`model` as a directory: a directory is used as it is, a known name
    (`inference.models.MODELS`) is converted (once; cached), anything else is refused."""
    from inference.models import MODELS, ModelUnavailable, cached_dir, ensure_model, is_converted

    name = str(model) if model is not None else ""
    if model is None or model.exists():
        return model
    if name not in MODELS:
        raise ConfigError(
            f"--model {name}: not a directory, nor a model name ({', '.join(sorted(MODELS))})"
        )
    try:
        if not is_converted(cached_dir(name)):
            say(f"converting {name} to a Hugging Face directory (once; about a minute)")
        return ensure_model(name)
    except ModelUnavailable as exc:
        raise ConfigError(f"--model {name}: {exc}") from None
    except RuntimeError as exc:  # the converted model failed its check question
        raise StartupError(f"--model {name}: {exc}") from None
