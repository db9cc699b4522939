"""`bench e2e --model smollm2`: both sides get the demo's settings, the worker's prompt and
the environment's reward, checked without training (the smoke run covers the toy's loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._e2e_setups import smollm2_setup, toy_setup
from bench._trl_grpo import arith_reward, arith_rows
from bench.e2e import parse
from envs.arith import answer_of
from envs.registry import make
from farm.demo_settings import SETTINGS
from workers.tokens import ChatCodec, load_tokenizer


def test_trl_prompts_are_the_workers_first_prompts(smollm2_dir: Path) -> None:
    """TRL renders a row's prompt with `apply_chat_template(..., add_generation_prompt=True,
    tokenize=True)` (its `_tokenize_prompts`); the token ids must be the worker's."""
    tok = load_tokenizer(str(smollm2_dir))
    codec = ChatCodec(tok)
    env = make("arith")
    rows = arith_rows()
    assert [r["index"] for r in rows] == list(range(len(env.problems)))
    for row in rows[:5]:
        observation, _ = env.reset(options={"row": {"index": row["index"]}})
        ids = tok.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert list(ids) == codec.initial_prompt(observation, env.system_prompt, env.tools)


def test_trl_reward_is_the_arith_environments() -> None:
    problems = make("arith").problems
    (a, op, b), (c, _, d) = problems[3], problems[7]
    right, other = answer_of(problems[3]), answer_of(problems[7])
    completions = [
        [{"role": "assistant", "content": f"{a} {op} {b} = {right}"}],  # ends with the sum
        [{"role": "assistant", "content": f"{right}\n\nThis is a classic"}],  # rambles on
        [{"role": "assistant", "content": f"{c}+{d} = {other + 1}"}],  # wrong
        f"The answer is {other}.",  # a plain-text completion
    ]
    assert arith_reward(completions, index=[3, 3, 7, 7]) == [1.0, 0.0, 0.0, 1.0]


def test_smollm2_setup_is_the_demo_row() -> None:
    row = SETTINGS[("smollm2", "arith")]
    args, systems = parse(["--model", "smollm2"])
    assert systems == ["farm", "trl"]
    setup = smollm2_setup(args, Path("/models/smollm2"))
    trl = setup.trl_settings(seed=3)
    assert trl == {
        "task": "arith",
        "model": "/models/smollm2",
        "learning_rate": row.learning_rate,
        "group_size": row.group_size,
        "groups_per_batch": row.groups_per_batch,
        "micro_batch": 8,
        "warmup_steps": 0,
        "max_tokens": row.max_tokens,
        "temperature": row.temperature,
        "max_steps": 12,
        "window": 3,
        "target": 0.5,
        "seed": 3,
    }
    flags = list(setup.farm_args)
    assert flags[0] == "--env=arith"
    for learner_flag in ("--micro-batch-size", "8", "--max-staleness", "0", str(row.learning_rate)):
        assert f"--learner-arg={learner_flag}" in flags
    assert f"--worker-arg={row.max_tokens}" in flags


def test_a_given_learning_rate_reaches_both_sides_once() -> None:
    args, _ = parse(["--model", "smollm2", "--learning-rate", "1e-05", "--target", "0.6"])
    setup = smollm2_setup(args, Path("/m"))
    assert setup.trl_settings(0)["learning_rate"] == 1e-5 and setup.target == 0.6
    lrs = [f for f in setup.farm_args if f.startswith("--learner-arg=--learning-rate")]
    values = [setup.farm_args[setup.farm_args.index(f) + 1] for f in lrs]
    assert values == ["--learner-arg=1e-05"]


def test_the_toy_keeps_its_settings() -> None:
    args, _ = parse([])
    setup = toy_setup(args, Path("/tiny"))
    trl = setup.trl_settings(0)
    assert (trl["task"], trl["micro_batch"], trl["warmup_steps"], trl["max_tokens"]) == (
        "toy",
        128,
        10,
        1,
    )
    assert (setup.learning_rate, setup.target, setup.window, setup.max_steps) == (
        3e-3,
        0.4,
        10,
        400,
    )
    assert "--env=arith" not in setup.farm_args
    assert setup.farm_args[-2:] == ("--worker-arg=--max-tokens", "--worker-arg=1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "smollm2", "--smoke"], "--smoke runs the toy only"),
        (["--model", "qwen3"], "invalid choice: 'qwen3'"),
        (["--runs", "0"], "--runs: at least 1"),
        (["--systems", "farm,verl"], "unknown ['verl']"),
    ],
)
def test_bad_arguments_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
