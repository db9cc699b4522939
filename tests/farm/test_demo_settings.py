"""`farm demo`'s settings table and its plan: which row a model and an environment get, the
flags the row becomes, and the held-out file scored before and after training.

Pure parts on real inputs (the tiny model built here, SmolLM2's converted directory from the
model cache, the arith environment); the run itself is in test_demo.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.arith import split_problems
from envs.registry import make
from farm import demo_settings as table
from farm.cli import main, parser
from farm.config import FarmConfig
from farm.demo_plan import plan_demo
from farm.errors import ConfigError
from launch.settings import flag_values


def _plan(tmp_path: Path, *argv: str):
    args = parser().parse_args(["demo", "--work-dir", str(tmp_path / "run"), *argv])
    return plan_demo(None, flag_values(args, FarmConfig), None, lambda line: None)


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_smollm2_on_arith_gets_the_settings_it_was_measured_with() -> None:
    name, row = table.lookup("smollm2", "arith")
    assert name == "smollm2/arith"
    learner = table.learner_args(row)
    assert _flag(learner, "--learning-rate") == "2e-05"
    assert (_flag(learner, "--groups-per-batch"), _flag(learner, "--group-size")) == ("4", "8")
    assert table.worker_args(row) == ["--max-tokens", "12", "--temperature", "1.0"]
    assert row.stop_when_solved is False and row.max_steps == 8
    _, toy = table.lookup("tiny", "toy")
    assert _flag(table.learner_args(toy), "--learning-rate") == "0.003"
    assert table.worker_args(toy) == ["--max-tokens", "1", "--temperature", "1.0"]


def test_an_unmeasured_pair_falls_back_to_the_familys_row_or_is_refused() -> None:
    assert table.lookup("tiny", "codegym") == ("tiny/*", table.SETTINGS[("tiny", "*")])
    lookup = table.learner_args(table.lookup("tiny", "lookup")[1])
    assert _flag(lookup, "--entropy-coef") == "0.03"
    with pytest.raises(ConfigError, match=r"no settings for the model family 'smollm2' on 'toy'"):
        table.lookup("smollm2", "toy")


def test_the_family_comes_from_the_models_config(
    tiny_model_dir: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    assert table.model_family(None) == "tiny"
    assert table.model_family(tiny_model_dir) == "tiny"
    assert table.model_family(smollm2_dir) == "smollm2"
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 896}))
    with pytest.raises(ConfigError, match="knows the families smollm2, tiny"):
        table.model_family(tmp_path)
    with pytest.raises(ConfigError, match=r"no readable config\.json"):
        table.model_family(tmp_path / "missing")


def test_the_held_out_file_names_each_held_out_problem_once() -> None:
    # the split named in the training spec does not matter: the file is the held-out one
    for spec in ("arith", 'arith@{"max_operand": 12, "split": "train"}'):
        lines = table.heldout_lines(spec)
        assert lines is not None
        seen = []
        for line in lines:
            task = json.loads(line)
            env = make(task["env_spec"])
            env.reset(seed=0, options={"row": task["row"]})
            seen.append(env._problem)
        operand = json.loads(spec.partition("@")[2] or "{}").get("max_operand", 9)
        expected = split_problems(operand, "+", 0.2)["heldout"]
        assert sorted(seen) == sorted(expected) and len(set(seen)) == len(seen), spec
    assert len(table.heldout_lines("arith") or []) == 20
    assert table.heldout_lines('toy@{"difficulty": 0}') is None


@pytest.mark.parametrize("spec", ['arith@{"nope": 1}', 'calc@{"problems": "mul9x9"}'])
def test_a_bad_argument_of_the_held_out_environment_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"--env .*validation error"):
        table.heldout_lines(spec)


def test_demo_with_smollm2_trains_arith_and_scores_the_held_out_split_first_and_last(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    plan = _plan(tmp_path, "--model", "smollm2", "--learner-arg=--learning-rate=1e-5")
    cfg = plan.cfg
    assert (cfg.model, cfg.env_spec, plan.row_name) == (smollm2_dir, "arith", "smollm2/arith")
    assert (cfg.max_steps, cfg.progress.stop_when_solved) == (8, False)
    learner = cfg.learner_args
    assert learner[-1] == "--learning-rate=1e-5"  # the user's own follow the row's and win
    assert _flag(learner, "--eval-interval") == "8" and "--eval-before-train" in learner
    assert (_flag(learner, "--eval-samples"), _flag(learner, "--eval-max-tokens")) == ("4", "12")
    heldout = Path(_flag(learner, "--eval-tasks").removeprefix("heldout="))
    assert heldout.read_text().splitlines() == table.heldout_lines("arith")
    assert plan.eval_dir == Path(_flag(learner, "--eval-dir"))
    assert cfg.worker_args == ["--max-tokens", "12", "--temperature", "1.0"]
    assert plan.settings()["learner_args"] == learner
    # a step limit of the user's own moves the last evaluation with it
    short = _plan(tmp_path, "--model", str(smollm2_dir), "--max-steps", "3")
    assert _flag(short.cfg.learner_args, "--eval-interval") == "3"


def test_demo_with_smollm2_on_calc_reads_hermes_calls_and_scores_every_held_out_problem(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    plan = _plan(tmp_path, "--model", str(smollm2_dir), "--env", "calc")
    cfg = plan.cfg
    # the calculator runs in the workers' sandbox pool: bubblewrap, which needs no image
    spec = 'calc@{"calculator": "sandbox"}'
    assert (plan.row_name, cfg.env_spec, cfg.sandbox_backend) == ("smollm2/calc", spec, "bwrap")
    assert plan.settings()["sandbox_backend"] == "bwrap"
    assert cfg.worker_args[:6] == [
        *("--max-tokens", "64", "--temperature", "1.0", "--tool-parser", "hermes")
    ]
    assert _flag(cfg.worker_args, "--inference-request-timeout-s") == "300"
    learner = cfg.learner_args
    assert (_flag(learner, "--eval-samples"), _flag(learner, "--eval-max-tokens")) == ("2", "64")
    lines = Path(_flag(learner, "--eval-tasks").removeprefix("heldout=")).read_text().splitlines()
    specs = {json.loads(line)["env_spec"] for line in lines}
    assert len(lines) == 40 and specs == {'calc@{"split": "heldout", "calculator": "sandbox"}'}
    assert sorted(json.loads(line)["row"]["index"] for line in lines) == list(range(40))
    # the user's own environment settings and sandbox win over the row's
    own = _plan(
        tmp_path,
        *("--model", str(smollm2_dir), "--sandbox-backend", "docker"),
        *("--env", 'calc@{"calculator": "worker", "shots": 3}'),
    )
    assert own.cfg.env_spec == 'calc@{"calculator": "worker", "shots": 3}'
    assert own.cfg.sandbox_backend == "docker"


def test_demo_defaults_stay_the_toy_on_the_tiny_model_and_refuse_unmeasured_pairs(
    tmp_path: Path,
) -> None:
    plan = _plan(tmp_path)
    assert (plan.row_name, plan.cfg.env_spec, plan.eval_dir) == (
        "tiny/toy",
        'toy@{"difficulty": 0}',
        None,
    )
    assert (plan.cfg.max_steps, plan.cfg.progress.stop_when_solved) == (500, True)
    assert "--eval-tasks" not in plan.cfg.learner_args
    with pytest.raises(ConfigError, match="'smollm2' on 'toy'"):
        _plan(tmp_path, "--model", "smollm2", "--env", "toy")


def test_a_model_the_demo_has_no_settings_for_stops_it_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (model := tmp_path / "qwen").mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 896, "vocab_size": 151936}))
    assert main(["demo", "--model", str(model), "--work-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"farm: --model {model}: farm demo knows the families"), err
    assert "train it with `farm up`" in err and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"smolm2: not a directory, nor a model name \(smollm2\)"):
        _plan(tmp_path, "--model", "smolm2")
