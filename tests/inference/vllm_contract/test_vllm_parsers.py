"""The project's tool-call and reasoning parsers against vLLM 0.33's own, on the same outputs.

vLLM's parsers (`vllm/tool_parsers/`, `vllm/reasoning/`) run in a process with the contract
environment (parser_probe.py) over generated model outputs: well-formed calls, several calls,
text around them, unclosed tags, wrong shapes, broken JSON. For every output where vLLM's
parser finds calls, `envs.parsing.parse_with` finds the same calls (names and arguments, in
order) and the same content, with no error; where vLLM finds none, ours finds none, and an
attempt in the family's syntax is an error that the environment feeds back. The reasoning
parsers split every output into the same reasoning and answer as vLLM's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from envs.parsing import parse_with
from envs.reasoning import split
from tests.chat_models import tokenizer_dir
from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env, ensure_parser_env

ROOT = Path(__file__).resolve().parents[3]
CALL = '{"name": "lookup", "arguments": {"key": "k", "n": [1, {"deep": null}]}}'
FRAGMENTS = {
    "hermes": [
        "Sure. ",
        "\n",
        " ",
        "<tool_call>",
        "</tool_call>",
        "<tool_call>\n",
        "\n</tool_call>",
        CALL,
        '{"name": "lookup", "arguments": "{\\"key\\": 1}"}',
        '{"name": "f"}',
        '{"arguments": {}}',
        "[1]",
        "{bad",
        '{"name": 5, "arguments": {}}',
        '{"name": "x", "arguments": [1, 2]}',
        "ünï ✓",
    ],
    "llama3_json": [
        '{"name": "lookup", "parameters": {"key": "k"}}',
        CALL,
        "<|python_tag|>",
        "; ",
        "Text ",
        "{not json}",
        '{"x": 1}',
        "}",
        "{",
        " ",
        "\n",
        '{"name": 3, "parameters": {}}',
    ],
    "mistral": [
        "[TOOL_CALLS]",
        " ",
        f" [{CALL}]",
        '{"name": "f", "arguments": "{\\"a\\": 1}"}',
        ' [{"name": "a"}, {"arguments": {"x": 1}}]',
        '[1, {"name": "b", "arguments": null}]',
        "Hello ",
        "{bad",
        "]",
        "[",
        " trailing",
        "\n",
    ],
    "pythonic": [
        "[",
        "]",
        'lookup(key="k")',
        "f(a=1, b=null)",
        "g.h(x=-2.5)",
        ", ",
        "f(1)",
        "f(a=x)",
        'f(a={"k": [1, (2, 3)], "s": {4}})',
        "text",
        " ",
        "\n",
        "f(**k)",
        "f(a=f'x')",
        "f(a=True, b=None)",
        "f(a=1 + 2)",
    ],
}
REASONING_FRAGMENTS = [
    "<think>",
    "</think>",
    "\n",
    "hmm ",
    "answer",
    "<tool_call>",
    CALL,
    "</tool_call>",
    " ",
]
TOKENIZERS = {
    "hermes": "qwen3",
    "llama3_json": "llama3.2",
    "mistral": "mistral",
    "pythonic": "qwen3",
}


GOOD_JSON = [
    CALL,
    '{"name": "lookup", "arguments": {}}',
    '{"name": "other", "arguments": {"q": "ünï \\"quoted\\"", "x": -1.5, "b": true}}',
]
BAD_JSON = ['{"name": "f"}', '{"arguments": {}}', "{bad", '{"name": 5, "arguments": {}}', "[1]", ""]
GOOD_PY = ['lookup(key="k")', "f(a=1, b=null)", "g.h(x=-2.5)", 'f(a={"k": [1, (2, 3)]})', "f()"]
BAD_PY = ["f(1)", "f(a=x)", "f(**k)", "f(a=1 + 2)", "f(a=", "3"]


def _pick(rng: random.Random, good: list[str], bad: list[str]) -> str:
    return rng.choice(good) if rng.random() < 0.75 else rng.choice(bad)


def _hermes(rng: random.Random) -> str:
    parts = [rng.choice(["", "Sure. ", "ünï ✓\n"])]
    count = rng.randint(1, 3)
    for i in range(count):
        closed = i < count - 1 or rng.random() < 0.8
        close = rng.choice(["</tool_call>", "\n</tool_call>"]) if closed else ""
        parts += [
            rng.choice(["<tool_call>", "<tool_call>\n"]),
            _pick(rng, GOOD_JSON, BAD_JSON),
            close,
        ]
        parts.append(rng.choice(["", "\n", " "]))
    return "".join(parts) + rng.choice(["", " trailing"])


def _llama(rng: random.Random) -> str:
    calls = [
        _pick(
            rng, [g.replace('"arguments"', '"parameters"') for g in GOOD_JSON] + GOOD_JSON, BAD_JSON
        )
        for _ in range(rng.randint(1, 2))
    ]
    return rng.choice(["", "<|python_tag|>", "Text "]) + "; ".join(calls) + rng.choice(["", "\n"])


def _mistral(rng: random.Random) -> str:
    calls = ", ".join(_pick(rng, GOOD_JSON, BAD_JSON) for _ in range(rng.randint(1, 2)))
    body = rng.choice([f"[{calls}]", calls, f"[{calls}", "{bad"])
    return (
        rng.choice(["", "Hello "])
        + "[TOOL_CALLS]"
        + rng.choice(["", " "])
        + body
        + rng.choice(["", " trailing"])
    )


def _pythonic(rng: random.Random) -> str:
    calls = ", ".join(_pick(rng, GOOD_PY, BAD_PY) for _ in range(rng.randint(1, 3)))
    return rng.choice(["", "", "text "]) + f"[{calls}]" + rng.choice(["", "", "\n", " tail"])


BUILDERS = {"hermes": _hermes, "llama3_json": _llama, "mistral": _mistral, "pythonic": _pythonic}


def _texts(fragments: list[str], count: int, seed: int, build=None) -> list[str]:
    """The fragments alone, `count` soups of them, and `count` texts from `build`."""
    rng = random.Random(seed)
    texts = list(fragments)
    texts += ["".join(rng.choices(fragments, k=rng.randint(1, 5))) for _ in range(count)]
    if build is not None:
        texts += [build(rng) for _ in range(count)]
    return texts


def _vllm(jobs: list[dict]) -> list[dict]:
    try:
        dirs = [ensure_env(), ensure_parser_env()]
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment ({exc})")
        raise
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(map(str, [*dirs, ROOT])),
        "VLLM_LOGGING_LEVEL": "CRITICAL",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.inference.vllm_contract.parser_probe"],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def verdicts() -> dict[str, list[tuple[str, dict]]]:
    """For each of our parser names: (text, vLLM's verdict) over the generated texts."""
    names = [*FRAGMENTS, "qwen3_json"]
    cases = {
        n: _texts(FRAGMENTS.get(n, FRAGMENTS["hermes"]), 100, i, BUILDERS.get(n, _hermes))
        for i, n in enumerate(names)
    }
    by_tokenizer: dict[str, list[tuple[str, str]]] = {}
    for name, texts in cases.items():
        family = TOKENIZERS.get(name, "qwen3")
        by_tokenizer.setdefault(family, []).extend((name, t) for t in texts)
    reasoning = [
        [parser, kwargs, text]
        for parser, kwargs in (
            ("qwen3", {}),
            ("qwen3", {"enable_thinking": False}),
            ("deepseek_r1", {}),
        )
        for text in _texts(REASONING_FRAGMENTS, 120, 99)
    ]
    jobs = [
        {
            "tokenizer": str(tokenizer_dir(family)),
            "tool": pairs,
            "reasoning": reasoning if family == "qwen3" else [],
        }
        for family, pairs in by_tokenizer.items()
    ]
    out: dict[str, list[tuple[str, dict]]] = {}
    for job, result in zip(jobs, _vllm(jobs), strict=True):
        for (name, text), verdict in zip(job["tool"], result["tool"], strict=True):
            out.setdefault(name, []).append((text, verdict))
        if job["reasoning"]:
            out["reasoning"] = [
                (r, v) for r, v in zip(job["reasoning"], result["reasoning"], strict=True)
            ]  # type: ignore[misc]
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test builds the corpus' verdicts: importing vLLM, ~1 min
@pytest.mark.parametrize("parser", ["hermes", "qwen3_json", "llama3_json", "mistral", "pythonic"])
def test_tool_calls_are_vllms(verdicts, parser: str) -> None:
    called = 0
    for text, verdict in verdicts[parser]:
        ours = parse_with(parser, text)
        if verdict["called"]:
            called += 1
            theirs = [(name, json.loads(args)) for name, args in verdict["calls"]]
            assert ours.error is None, (text, ours.error)
            assert [(c.name, c.arguments) for c in ours.calls] == theirs, text
            assert ours.content == (verdict["content"] or ""), text
        else:
            assert not ours.calls, text
    assert called >= 25, f"only {called} texts with calls: the corpus tests little"


@pytest.mark.slow
def test_malformed_attempts_are_errors_not_content(verdicts) -> None:
    """Where vLLM hands a broken call back as content, ours says what is wrong with it."""
    marks = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
    for parser, mark in marks.items():
        broken = [t for t, v in verdicts[parser] if mark in t and not v["called"]]
        assert broken, parser
        assert all(parse_with(parser, t).error for t in broken), parser


@pytest.mark.slow
def test_reasoning_is_split_as_vllm_splits_it(verdicts) -> None:
    for (parser, kwargs, text), (reasoning, content) in verdicts["reasoning"]:
        ours = split(parser, text, thinking=kwargs.get("enable_thinking", True))
        assert (ours.reasoning, ours.answer) == (reasoning, content or ""), (parser, kwargs, text)
