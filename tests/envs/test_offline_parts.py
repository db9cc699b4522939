"""The sandbox-free parts of the built-in environments: problem and scenario files,
static reading of CodeGym sources, grading rules, stateful tools, spec errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import envs
from envs.code.env import CODERL_REWARDS, grade
from envs.code.grading import CaseResult, Evaluation, Outcome, extract_code
from envs.code.problems import load_problems, normalise_output
from envs.codegym.loader import _scan
from envs.codegym.sources import SourceError, library, read_source
from envs.errors import EnvSpecError
from envs.stateful.env import builtin_scenarios
from envs.stateful.library import CLASSES
from envs.tools import ToolCall, invoke_tool


@pytest.mark.parametrize("spec", ["code", 'codegym@{"env": "max_subarray"}', "stateful"])
def test_sandboxed_envs_demand_a_pool(spec: str) -> None:
    with pytest.raises(EnvSpecError, match="sandbox=pool"):
        envs.make(spec)


def test_all_builtins_registered() -> None:
    assert {"toy", "http", "code", "codegym", "stateful"} <= set(envs.registered())


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ('code@{"reward": "gold"}', "bad kwargs"),
        ('code@{"problem_ids": ["nope"]}', "unknown problem ids"),
        ('codegym@{"env": "nope"}', "unknown codegym environment"),
        ('codegym@{"env": "max_subarray", "config_index": 99}', "out of range"),
        ('stateful@{"scenario": "nope"}', "unknown scenario"),
        ("codegym", "missing a required argument: 'env'"),
    ],
)
def test_bad_sandboxed_specs(spec: str, fragment: str) -> None:
    with pytest.raises(EnvSpecError, match=fragment):
        envs.make(spec, sandbox=_PoolShape())


class _PoolShape:
    """Only satisfies the make()-time check; these specs fail before any session opens."""

    def session(self) -> None:
        raise AssertionError("no session may be opened for a bad spec")


def test_builtin_problems_and_whitespace_normalisation() -> None:
    problems = load_problems()
    assert {p.verify for p in problems} == {"stdio", "assert", "execution"}
    assert normalise_output("  1   2 \n\n3\n") == normalise_output("1 2\n3") == ["1 2", "3"]
    assert normalise_output("12") != normalise_output("1 2")


def test_problem_files_validated(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "x", "prompt": "p", "verify": "stdio", "tests": [{"input": "1"}]}) + "\n"
    )
    with pytest.raises(ValueError, match="needs tests with 'output'"):
        load_problems(str(bad))
    with pytest.raises(EnvSpecError):
        envs.make(f'code@{{"problems_file": "{bad}"}}', sandbox=_PoolShape())


def test_code_extraction() -> None:
    assert extract_code("text\n```python\nprint(1)\n```\nmore ```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_coderl_grades_and_other_rules() -> None:
    passed, failed = CaseResult(Outcome.PASSED, "passed"), CaseResult(Outcome.FAILED, "wrong")
    cases = {
        Outcome.COMPILE_ERROR: Evaluation(Outcome.COMPILE_ERROR),
        Outcome.RUNTIME_ERROR: Evaluation(
            Outcome.RUNTIME_ERROR, (passed, CaseResult(Outcome.RUNTIME_ERROR, "x"))
        ),
        Outcome.FAILED: Evaluation(Outcome.FAILED, (passed, failed)),
        Outcome.PASSED: Evaluation(Outcome.PASSED, (passed, passed)),
    }
    assert [grade(cases[o], "coderl", 2) for o in Outcome] == [-1.0, -0.6, -0.3, 1.0]
    assert CODERL_REWARDS[Outcome.RUNTIME_ERROR] == -0.6
    assert [grade(cases[o], "binary", 2) for o in Outcome] == [0.0, 0.0, 0.0, 1.0]
    assert [grade(cases[o], "fraction", 2) for o in Outcome] == [0.0, 0.5, 0.5, 1.0]


def test_codegym_library_has_five_envs_with_configs_and_oracles() -> None:
    lib = library()
    assert len(lib) >= 5
    for source in lib.values():
        assert source.configs and source.has_solve


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("def broken(:\n", "does not parse"),
        ("x = 1\n", "exactly one CodeGymEnv subclass"),
        ("class A(CodeGymEnv):\n    CONFIGS = [f()]\n", "must be a literal"),
        ("class A(CodeGymEnv):\n    CONFIGS = []\n", "non-empty list of dicts"),
        ("class A(CodeGymEnv):\n    pass\n", "non-empty list of dicts"),
    ],
)
def test_codegym_static_rejections(text: str, fragment: str) -> None:
    with pytest.raises(SourceError, match=fragment):
        read_source("user_env", text)


def test_loader_scan_reports_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "good.py").write_text("class G(CodeGymEnv):\n    CONFIGS = [{}]\n")
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "_private.py").write_text("ignored")
    found = dict(_scan(tmp_path))
    assert set(found) == {"good.py", "bad.py"}
    assert isinstance(found["bad.py"], str) and found["good.py"].class_name == "G"


def test_scenarios_valid_and_tools_mutate_state() -> None:
    scenarios = builtin_scenarios()
    assert len(scenarios) >= 3
    for scenario in scenarios.values():
        env = CLASSES[scenario.env]()
        env.load_state(scenario.initial_state)
        assert env.state_dict() == scenario.initial_state
    bank = CLASSES["Bank"]()
    bank.load_state(scenarios["bank_transfer"].initial_state)
    assert invoke_tool(
        bank, ToolCall("transfer", {"source": "alice", "target": "bob", "amount": 500})
    ).startswith("Error")
    assert (
        invoke_tool(bank, ToolCall("transfer", {"source": "alice", "target": "bob", "amount": 50}))
        == "Done."
    )
    assert bank.state_dict()["accounts"] == {"alice": 70, "bob": 60, "carol": 0}
    assert scenarios["bank_transfer"].initial_state["accounts"]["alice"] == 120  # not aliased
    with pytest.raises(ValueError, match="missing"):
        bank.load_state({"accounts": {}})


def test_codegym_tool_schemas_read_statically() -> None:
    tools = {t["function"]["name"]: t["function"] for t in library()["max_subarray"].tools}
    assert set(tools) == {"Add", "Done", "GetElement", "Max", "Observe"}
    assert tools["GetElement"]["parameters"] == {
        "type": "object",
        "properties": {"index": {"type": "integer", "description": "Zero-based position."}},
        "required": ["index"],
    }
    assert tools["Done"]["parameters"]["properties"]["answer"]["type"] == "string"
    text = (
        "class U(CodeGymEnv):\n    CONFIGS = [{}]\n\n    @tool\n"
        "    def Look(self, where: 'str', depth: list[int] = [], *, fast: bool) -> str:\n"
        '        """Look around.\n\n        Args:\n            where: Place.\n        """\n'
    )
    look = {t["function"]["name"]: t["function"] for t in read_source("u", text).tools}["Look"]
    assert look["description"] == "Look around."
    assert look["parameters"]["required"] == ["where", "fast"]
    assert look["parameters"]["properties"] == {
        "where": {"type": "string", "description": "Place."},
        "depth": {"type": "array", "items": {"type": "integer"}},
        "fast": {"type": "boolean"},
    }
