"""The ``code`` reward: the row's test cases run in the sandbox against the reply's code, as
the ``code`` environment runs its problems' tests (`envs.code.grading`).

The row's answer column holds the tests, as a JSON object (or its text)::

    {"verify": "stdio", "tests": [{"input": "2 3\\n", "output": "5"}]}
    {"verify": "assert", "tests": [{"assert": "assert add(2, 3) == 5"}]}
    {"verify": "execution", "stdin": ""}

The reward is the share of tests passed (0 on a compile error); it is returned as the
components ``passed`` (that share) so the dashboard shows it per env. A sandbox failure
stays a sandbox failure (`EnvInfraError`, category ``SANDBOX``).
"""

from __future__ import annotations

import json
from typing import Any

from envs.code.grading import evaluate, extract_code
from envs.code.problems import CodeProblem
from envs.sandboxed import SandboxPool, open_session, require_pool
from envs.toy import TRAILING_SPECIALS

TIMEOUT_S = 5.0  # wall-clock limit per test run, the code env's default


def problem_of(answer: Any, prompt: str = "(from the dataset)") -> CodeProblem:
    """The tests of a row's answer as a `CodeProblem`; ValueError when they are not tests."""
    if isinstance(answer, str):
        answer = json.loads(answer)
    if not isinstance(answer, dict):
        raise ValueError(f"the row's tests must be a JSON object, got {type(answer).__name__}")
    return CodeProblem.model_validate({"id": "row", "prompt": prompt, **answer})


async def code_reward(
    completion: str, answer: Any, sandbox: SandboxPool | None
) -> dict[str, float]:
    """The built-in ``code`` reward (see the module docstring)."""
    problem = problem_of(answer)
    pool = require_pool(sandbox, "the code reward")
    code = extract_code(TRAILING_SPECIALS.sub("", completion))
    async with open_session(pool) as sb:
        evaluation = await evaluate(sb, problem, code, TIMEOUT_S)
    total = max(1, len(problem.tests))
    return {"passed": evaluation.passed / total}
