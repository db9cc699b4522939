"""The calc environment and its calculator: safe evaluation, splits, the reward, an episode."""

from __future__ import annotations

import json
import time

import pytest

import envs
from broker.messages import ErrorCategory
from envs.calc import answer_of, final_number, heldout_problems, split_lines
from envs.calculator import MAX_ABS, CalculatorError, evaluate
from envs.errors import EnvSpecError, EnvStateError
from envs.parsing import Action, parse_with

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


def hermes(text: str) -> Action:
    """The action a worker whose run names `--tool-parser hermes` hands the environment."""
    return Action(text, parse_with("hermes", text))


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347*28", "9716"),
        (" 347 \u00d7 28 ", "9716"),
        ("123+456+789", "1368"),
        ("10/4", "2.5"),
        ("10/2", "5"),
        ("2^10", "1024"),
        ("-(3-5)*2", "4"),
        ("(" * 90 + "1" + ")" * 90, "1"),  # parentheses alone nest nothing
        ("7//2 + 7%2", "4"),
        ("2**-1", "0.5"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('id')", "function call"),
        ("().__class__", "not"),
        ("x + 1", "the name 'x'"),
        ("'a' * 3", "not a number"),
        ("1 < 2", "not"),
        ("True + 1", "not a number"),
        ("9**9**9", "larger than"),
        ("10**41", "larger than"),
        ("2**200000000", "larger than"),
        ("(10**20)*(10**21)", "larger than"),
        ("1e400", "not a finite number"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0**-1", "division by zero"),
        ("(-8)**0.5", "no real value"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than"),
        ("1+(" * 45 + "1" + ")" * 45, "nested too deeply"),
        ("-" * 150 + "1", "nested too deeply"),
    ],
)
def test_the_calculator_refuses_with_a_reason_and_never_crashes(
    expression: str, reason: str
) -> None:
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - started < 0.1  # bounded work: nothing huge is computed
    assert MAX_ABS == 10**40


def test_the_calculator_refuses_a_non_text_expression() -> None:
    with pytest.raises(CalculatorError, match="must be text"):
        evaluate(12)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reply", "number"),
    [
        ("9716", 9716),
        ("The answer is 9,716.", 9716),
        ("347 * 28 = 9716<|im_end|>", 9716),
        ("It is 9716.0", 9716),
        ("-12", -12),
        ("no number", None),
        ("about 9716.5", None),
    ],
)
def test_the_final_number_is_the_last_one_said(reply: str, number: int | None) -> None:
    assert final_number(reply) == number


@pytest.mark.parametrize("problems", ["mul2x2", "mul3x2", "add3x3"])
async def test_splits_are_disjoint_and_deterministic(problems: str) -> None:
    held = heldout_problems(problems, 40)
    assert len(set(held)) == 40
    assert heldout_problems.__wrapped__(problems, 40) == held  # the split never moves
    names = {"*".join(map(str, p)) if "mul" in problems else "+".join(map(str, p)) for p in held}
    train = envs.make(f'calc@{{"problems": "{problems}"}}')
    seen = set()
    for seed in range(400):
        obs, info = await envs.areset(train, seed=seed)
        assert (await envs.areset(train, seed=seed))[0] == obs
        seen.add(info["problem"])
    assert not seen & names and len(seen) > 300
    lines = split_lines(problems=problems)
    heldout = envs.make(json.loads(lines[0])["env_spec"])
    covered = set()
    for line in lines:
        row = json.loads(line)
        _, info = await envs.areset(heldout, seed=0, options={"row": row["row"]})
        covered.add(info["problem"])
    assert covered == names  # the eval file names each held-out problem exactly once


async def test_a_row_must_name_a_held_out_problem() -> None:
    with pytest.raises(EnvSpecError, match="index"):
        await envs.areset(envs.make('calc@{"split": "heldout"}'), options={"row": {"index": 40}})
    with pytest.raises(EnvSpecError, match="train split draws"):
        await envs.areset(envs.make("calc"), options={"row": {"index": 0}})
    with pytest.raises(EnvSpecError, match="style"):
        envs.check_spec('calc@{"style": "xml"}')


async def _start(spec: str = "calc", seed: int = 3) -> tuple[object, str, int]:
    env = envs.make(spec)
    _, info = await envs.areset(env, seed=seed)
    return env, info["problem"], answer_of(tuple(map(int, info["problem"].split("*"))), "mul3x2")


async def test_a_hermes_episode_calls_the_tool_reads_the_result_and_answers() -> None:
    env, problem, answer = await _start()
    assert env.tools[0]["function"]["name"] == "calculator"  # type: ignore[attr-defined]
    obs, reward, terminated, truncated, info = await envs.astep(env, hermes(CALL % problem))
    assert obs == [
        {
            "role": "tool",
            "content": str(answer),
            "tool_call_id": obs[0]["tool_call_id"],
            "name": "calculator",
        }
    ]
    assert obs[0]["tool_call_id"].startswith("call_")  # the hermes parser's id, echoed
    assert (reward, terminated, truncated, info["tool_results"]) == (
        0.0,
        False,
        False,
        [str(answer)],
    )
    _, reward, terminated, _, info = await envs.astep(env, hermes(f"The answer is {answer}."))
    assert (reward, terminated, info["correct"]) == (1.0, True, True)
    with pytest.raises(EnvStateError):
        await envs.astep(env, hermes("1"))


@pytest.mark.parametrize(
    ("first", "detail"),
    [
        ("<tool_call>{not json</tool_call>", "malformed"),
        (CALL % "__import__('os')", "function call"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>', "one argument"),
    ],
)
async def test_a_bad_call_is_an_error_observation_and_the_episode_goes_on(
    first: str, detail: str
) -> None:
    env, problem, answer = await _start()
    obs, reward, terminated, _, info = await envs.astep(env, hermes(first))
    assert (reward, terminated, info["error"]) == (0.0, False, ErrorCategory.FORMAT)
    assert obs[0]["content"].startswith("Error:") and detail in obs[0]["content"]
    await envs.astep(env, hermes(CALL % problem))  # it may call again, then answer
    _, reward, terminated, _, _ = await envs.astep(env, hermes(str(answer)))
    assert (reward, terminated) == (1.0, True)


async def test_a_right_answer_without_the_tool_scores_only_when_not_required() -> None:
    env, _, answer = await _start()
    _, reward, terminated, _, info = await envs.astep(env, hermes(str(answer)))
    assert (reward, terminated, info["correct"], info["said"]) == (0.0, True, False, str(answer))
    env, _, answer = await _start('calc@{"require_tool": false}')
    assert (await envs.astep(env, hermes(str(answer))))[1] == 1.0


async def test_a_wrong_answer_after_the_tool_scores_zero() -> None:
    env, problem, answer = await _start()
    await envs.astep(env, hermes(CALL % problem))
    _, reward, terminated, _, _ = await envs.astep(env, hermes(f"{answer} or {answer + 1}"))
    assert (reward, terminated) == (0.0, True)


async def test_calls_without_an_answer_are_truncated_after_max_turns() -> None:
    env, problem, _ = await _start('calc@{"max_turns": 2}')
    assert (await envs.astep(env, hermes(CALL % problem)))[3] is False
    *_, truncated, info = await envs.astep(env, hermes(CALL % problem))
    assert truncated and info["truncated_by"] == "max_turns"


async def test_the_tag_style_reads_its_own_syntax() -> None:
    env, problem, answer = await _start('calc@{"style": "tag"}')
    assert env.tools is None and "<calc>" in env.system_prompt  # type: ignore[attr-defined]
    obs, *_ = await envs.astep(env, f"Let me compute. <calc>{problem}</calc>")
    assert obs[0]["content"] == str(answer)
    _, reward, terminated, _, _ = await envs.astep(env, str(answer))
    assert (reward, terminated) == (1.0, True)


async def test_worked_exchanges_come_before_the_question_and_are_never_held_out() -> None:
    env = envs.make('calc@{"shots": 2, "instructions": false}')
    assert env.system_prompt is None  # type: ignore[attr-defined]  # SmolLM2's own, plus the tools
    first, _ = await envs.areset(env, seed=1)
    second, info = await envs.areset(env, seed=2)
    assert first[:-1] == second[:-1]  # one shared prefix: the server's prefix cache reuses it
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert second[-1]["content"] == f"What is {info['problem']}?"
    held = {f"What is {a}*{b}?" for a, b in heldout_problems("mul3x2", 1000)}
    assert not {m["content"] for m in first if m["role"] == "user"} & held
    shown = first[1]["content"]
    call = parse_with("hermes", shown).calls[0]
    assert evaluate(call.arguments["expression"]) == first[2]["content"] == first[3]["content"]
    tag = envs.make('calc@{"style": "tag", "shots": 1}')
    assert (await envs.areset(tag, seed=1))[0][1]["content"].startswith("<calc>")


async def test_the_prompt_renders_with_smollm2s_tools_template_as_the_worker_renders_it() -> None:
    from inference.models import SMOLLM2_TOOLS_TEMPLATE
    from inference.tiny import build_tokenizer
    from workers.tokens import ChatCodec

    tokenizer = build_tokenizer()
    tokenizer.chat_template = SMOLLM2_TOOLS_TEMPLATE
    codec = ChatCodec(tokenizer)
    env = envs.make("calc")
    first, info = await envs.areset(env, seed=5)
    prompt = codec.initial_prompt(first, env.system_prompt, env.tools)  # type: ignore[attr-defined]
    text = codec.decode(prompt, skip_special=False)
    assert text.startswith("<|im_start|>system\nUse the calculator tool")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]  # the schema, Hermes style
    assert text.count("<tool_call>") == 4  # the template's two in its format lines, two shots
    assert text.count("<tool_response>") == 2
    assert text.endswith(
        f"<|im_start|>user\nWhat is {info['problem']}?<|im_end|>\n<|im_start|>assistant\n"
    )
    obs, *_ = await envs.astep(env, hermes(CALL % info["problem"]))
    after = codec.decode(codec.observation_ids(obs), skip_special=False)
    assert f"<tool_response>\n{obs[0]['content']}\n</tool_response>" in after
