"""The `dataset` environment and reward functions: a row's prompt in, the reward function's
score out; a reward function that fails is the infrastructure's failure, never a 0."""

from __future__ import annotations

import json
from importlib.util import find_spec
from typing import Any

import pytest

import envs
from broker.messages import ErrorCategory
from envs.dataset import DatasetEnvConfig, check_row
from envs.errors import EnvInfraError, EnvSpecError
from envs.rewards import resolve
from tests.conftest import require
from tests.envs import rewardfns

FNS = "tests.envs.rewardfns"


def _env(**kwargs: Any) -> Any:
    return envs.make("dataset@" + json.dumps(kwargs))


async def _reply(env: Any, row: dict[str, Any], text: str) -> tuple[Any, ...]:
    observation, _ = await envs.areset(env, seed=3, options={"row": row})
    return (observation, *(await envs.astep(env, text)))


ROW = {"question": "What is 3+4?", "answer": "7", "source": "gsm"}


async def test_a_rows_prompt_is_the_observation_and_exact_scores_the_reply() -> None:
    env = _env(prompt_column="question", reward="exact")
    observation, _, reward, terminated, truncated, info = await _reply(env, ROW, " 7<|im_end|>")
    assert observation == "What is 3+4?"
    assert (reward, terminated, truncated, info) == (1.0, True, False, {})
    assert (await _reply(env, ROW, "8"))[2] == 0.0


async def test_regex_matches_the_answer_pattern() -> None:
    env = _env(prompt_column="question", reward="regex")
    row = {**ROW, "answer": r"^\s*(7|seven)\.?$"}
    assert (await _reply(env, row, "seven."))[2] == 1.0
    assert (await _reply(env, row, "seventy"))[2] == 0.0


async def test_math_verify_grades_equivalent_answers() -> None:
    require(find_spec("math_verify") is not None, "math-verify (pip install 'rollout-farm[data]')")
    env = _env(prompt_column="question", reward="math")
    half = {**ROW, "answer": "\\frac{1}{2}"}
    assert (await _reply(env, half, "So the answer is \\boxed{0.5}."))[2] == 1.0
    assert (await _reply(env, half, "The answer is 2."))[2] == 0.0
    # a reply that would keep sympy busy for ever is cut by math-verify's own limit: 0
    assert (await _reply(env, half, "$10^{10^{10^{10}}}$"))[2] == 0.0


async def test_math_with_an_answer_math_verify_cannot_read_is_an_infra_failure() -> None:
    require(find_spec("math_verify") is not None, "math-verify (pip install 'rollout-farm[data]')")
    env = _env(prompt_column="question", reward="math")
    with pytest.raises(EnvInfraError, match="cannot parse the row's answer") as caught:
        await _reply(env, {**ROW, "answer": "no number here"}, "7")
    assert caught.value.category is ErrorCategory.ENV


async def test_a_custom_function_gets_the_row_and_its_components_are_reported() -> None:
    env = _env(prompt_column="question", reward=f"{FNS}:length_parts")
    rewardfns.CALLS.clear()
    *_, reward, _, _, info = await _reply(env, {**ROW, "bonus": True}, "1234")
    assert reward == pytest.approx(1.5)
    assert info["reward_components"] == {"length": 0.5, "bonus": 1.0}
    assert rewardfns.CALLS == [{"completion": "1234", "row": {**ROW, "bonus": True}}]


async def test_an_async_function_gets_the_messages_and_the_answer() -> None:
    env = _env(prompt_column="question", reward=f"{FNS}:async_exact", system_prompt="Be brief.")
    rewardfns.CALLS.clear()
    assert (await _reply(env, ROW, "7"))[2] == 1.0
    assert rewardfns.CALLS[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"},
    ]
    assert rewardfns.CALLS[0]["answer"] == "7"


async def test_a_kwargs_function_gets_every_argument() -> None:
    env = _env(prompt_column="question", reward=f"{FNS}:everything")
    rewardfns.CALLS.clear()
    await _reply(env, ROW, "7")
    assert set(rewardfns.CALLS[0]) == {"completion", "messages", "row", "answer", "sandbox"}


@pytest.mark.parametrize(
    ("name", "limit_s", "message"),
    [
        ("raises", 5.0, "raised RuntimeError: the grader's database is down"),
        ("sleeps", 0.2, "took longer than 0.2s"),
        ("not_a_number", 5.0, "is 'yes', not a finite number"),
    ],
)
async def test_a_reward_function_that_fails_is_an_infra_failure(
    name: str, limit_s: float, message: str
) -> None:
    env = _env(prompt_column="question", reward=f"{FNS}:{name}", reward_timeout_s=limit_s)
    with pytest.raises(EnvInfraError, match=message) as caught:
        await _reply(env, ROW, "7")
    assert caught.value.category is ErrorCategory.ENV
    assert caught.value.category.is_infrastructure


def test_a_reward_that_cannot_be_loaded_is_a_spec_error() -> None:
    with pytest.raises(EnvSpecError, match="could not be loaded"):
        _env(reward=f"{FNS}:missing")
    with pytest.raises(EnvSpecError, match="built-in"):
        resolve("nonsense")
    with pytest.raises(EnvSpecError, match="takes none of"):
        resolve(f"{FNS}:takes_nothing_known")


async def test_messages_column_is_the_prompt() -> None:
    env = _env(messages_column="chat", reward="exact")
    chat = [
        {"role": "system", "content": "Answer in digits."},
        {"role": "user", "content": "What is 3+4?"},
    ]
    observation, *_ = await _reply(env, {"chat": chat, "answer": "7"}, "7")
    assert observation == chat


async def test_tools_make_it_multi_turn_and_the_answer_ends_it() -> None:
    env = _env(prompt_column="question", reward=f"{FNS}:async_exact", tools=f"{FNS}:Calculator")
    await envs.areset(env, seed=0, options={"row": ROW})
    assert [t["function"]["name"] for t in env.tools] == ["add"]
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    observation, reward, terminated, truncated, _ = await envs.astep(env, call)
    assert observation == [{"role": "tool", "content": "7"}]
    assert (reward, terminated, truncated) == (0.0, False, False)
    rewardfns.CALLS.clear()
    assert (await envs.astep(env, "7"))[1:3] == (1.0, True)
    assert [m["role"] for m in rewardfns.CALLS[0]["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


def test_check_row_names_what_is_wrong() -> None:
    config = DatasetEnvConfig(prompt_column="question", reward="math")
    check_row(config, ROW)
    with pytest.raises(ValueError, match=r"'question' .* must be non-empty text, got missing"):
        check_row(config, {"answer": "7"})
    with pytest.raises(ValueError, match="got int"):
        check_row(config, {"question": 3, "answer": "7"})
    with pytest.raises(ValueError, match=r"'answer' .* missing or null"):
        check_row(config, {"question": "q"})
    with pytest.raises(ValueError, match="bad regex"):
        check_row(DatasetEnvConfig(prompt_column="q", reward="regex"), {"q": "x", "answer": "("})
    with pytest.raises(ValueError, match="bad tests"):
        check_row(DatasetEnvConfig(prompt_column="q", reward="code"), {"q": "x", "answer": "{}"})
    with pytest.raises(ValueError, match="list of"):
        check_row(DatasetEnvConfig(messages_column="m", reward="exact"), {"m": "hi", "answer": 1})


async def test_a_task_without_a_row_cannot_run_the_dataset_env() -> None:
    env = _env(prompt_column="question", reward="exact")
    with pytest.raises(EnvSpecError, match="row is unusable"):
        await envs.areset(env, seed=0)


async def test_a_row_for_an_env_that_takes_none_is_refused_not_dropped() -> None:
    env = envs.make("toy")
    with pytest.raises(EnvSpecError, match="takes no dataset row"):
        await envs.areset(env, seed=0, options={"row": {"x": 1}})


async def test_code_runs_the_rows_tests_in_the_sandbox(bwrap_pool: Any) -> None:
    env = envs.make('dataset@{"prompt_column": "q", "reward": "code"}', sandbox=bwrap_pool)
    tests = {"verify": "assert", "tests": [{"assert": "assert add(2, 3) == 5"}]}
    row = {"q": "Write add(a, b).", "answer": json.dumps(tests)}
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    *_, reward, _, _, info = await _reply(env, row, good)
    assert (reward, info["reward_components"]) == (1.0, {"passed": 1.0})
    assert (await _reply(env, row, "def add(a, b):\n    return a - b"))[2] == 0.0
