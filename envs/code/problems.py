"""Coding problems for the ``code`` environment: their schema and where they come from.

A problem names its verification mode: ``stdio`` (each test is an input and the
expected output, compared after whitespace normalisation), ``assert`` (each test
is a Python snippet of assertions run after the solution) or ``execution`` (the
program only has to run cleanly). The built-in set ships as
``envs/data/code_problems.json``; users give their own as a JSON list or JSONL
file with the same fields.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Literal

import pydantic

Verify = Literal["stdio", "assert", "execution"]


class CodeTest(pydantic.BaseModel):
    """One test case: ``input``/``output`` for stdio problems, ``assert`` for assertion problems."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    input: str = pydantic.Field("", description="stdin given to the program (stdio)")
    output: str | None = pydantic.Field(None, description="expected stdout (stdio)")
    assertion: str | None = pydantic.Field(
        None, alias="assert", description="assertion code (assert)"
    )


class CodeProblem(pydantic.BaseModel):
    """A task statement with its tests."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    id: str = pydantic.Field(min_length=1, description="unique name")
    prompt: str = pydantic.Field(min_length=1, description="the task shown to the model")
    verify: Verify = pydantic.Field(description="how a solution is checked")
    tests: tuple[CodeTest, ...] = pydantic.Field((), description="test cases (none for execution)")
    stdin: str = pydantic.Field("", description="stdin for execution-only problems")

    @pydantic.model_validator(mode="after")
    def _tests_match_mode(self) -> CodeProblem:
        if self.verify == "stdio" and (not self.tests or any(t.output is None for t in self.tests)):
            raise ValueError(f"stdio problem {self.id!r} needs tests with 'output'")
        if self.verify == "assert" and (not self.tests or any(not t.assertion for t in self.tests)):
            raise ValueError(f"assert problem {self.id!r} needs tests with 'assert'")
        return self


def normalise_output(text: str) -> list[str]:
    """Whitespace-insensitive form of program output: tokens per non-empty line."""
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def load_problems(path: str | None = None) -> tuple[CodeProblem, ...]:
    """Load a JSON list or JSONL file of problems (the built-in set when ``path`` is None)."""
    if path is None:
        text = resources.files("envs.data").joinpath("code_problems.json").read_text()
    else:
        text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    problems = tuple(CodeProblem.model_validate(r) for r in records)
    if not problems:
        raise ValueError(f"no problems in {path or 'the built-in set'}")
    if len({p.id for p in problems}) != len(problems):
        raise ValueError("problem ids must be unique")
    return problems
