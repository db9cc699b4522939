"""The ``code`` environment: write a Python program or function that passes tests.

Single-turn by default: the model answers with code (a fenced block or bare), it
runs in the sandbox against the problem's tests, and the episode terminates with
the reward. With ``max_attempts > 1`` a failed attempt returns test feedback
(which tests passed, errors, and — only with ``reveal_expected`` — the expected
outputs) and the model tries again; intermediate attempts score 0, the final one
its grade. Passing ends the episode as *terminated*; running out of attempts ends
it as *truncated* (``truncated_by="max_attempts"``).

Rewards (``reward`` kwarg): ``binary`` (1 all pass, else 0), ``fraction`` (share of
tests passed; 0 on a compile error) or ``coderl`` (-1 compile error, -0.6 runtime
error, -0.3 a failing test, +1 all pass).
"""

from __future__ import annotations

import random
from typing import Any, Literal

import pydantic

from envs.api import Env, ResetResult, StepResult
from envs.code.grading import Evaluation, Outcome, evaluate, extract_code
from envs.code.problems import CodeProblem, Verify, load_problems
from envs.errors import EnvStateError
from envs.registry import spec_config
from envs.sandboxed import SandboxPool, open_session, require_pool

CODERL_REWARDS = {
    Outcome.COMPILE_ERROR: -1.0,
    Outcome.RUNTIME_ERROR: -0.6,
    Outcome.FAILED: -0.3,
    Outcome.PASSED: 1.0,
}
SYSTEM_PROMPT = (
    "You are a careful Python programmer. Answer with the complete code in one ```python block."
)


class CodeConfig(pydantic.BaseModel):
    """Configuration of the code environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    problems_file: str | None = pydantic.Field(
        None, description="JSON/JSONL problems; built-ins if unset"
    )
    verify: Verify | None = pydantic.Field(
        None, description="only problems of this mode (all if unset)"
    )
    problem_ids: tuple[str, ...] | None = pydantic.Field(None, description="only these problems")
    reward: Literal["binary", "fraction", "coderl"] = pydantic.Field(
        "binary", description="reward rule"
    )
    max_attempts: int = pydantic.Field(
        1, ge=1, le=20, description="attempts; >1 is multi-turn with feedback"
    )
    reveal_expected: bool = pydantic.Field(False, description="show expected outputs in feedback")
    timeout_s: float = pydantic.Field(
        5.0, gt=0, le=120, description="wall-clock limit per test run"
    )


def grade(evaluation: Evaluation, rule: str, total_tests: int) -> float:
    """The reward of one evaluated attempt under ``rule``."""
    if rule == "coderl":
        return CODERL_REWARDS[evaluation.outcome]
    if rule == "fraction":
        return evaluation.passed / max(1, total_tests)
    return 1.0 if evaluation.outcome is Outcome.PASSED else 0.0


def feedback(problem: CodeProblem, evaluation: Evaluation, reveal: bool) -> str:
    """Model-facing report of a failed attempt."""
    if evaluation.outcome is Outcome.COMPILE_ERROR:
        return f"Your code does not compile:\n{evaluation.compile_detail}\nTry again."
    lines = [f"{evaluation.passed}/{max(1, len(problem.tests))} tests passed."]
    for index, result in enumerate(evaluation.results):
        lines.append(f"Test {index + 1}: {result.detail}")
        if reveal and result.outcome is Outcome.FAILED and problem.verify == "stdio":
            test = problem.tests[index]
            lines.append(
                f"  input: {test.input!r}\n  expected: {test.output!r}\n  got: {result.stdout[:300]!r}"
            )
        if reveal and result.outcome is Outcome.FAILED and problem.verify == "assert":
            lines.append(f"  {problem.tests[index].assertion}")
    return "\n".join([*lines, "Try again."])


class CodeEnv(Env):
    """Code-with-tests environment; needs a SandboxPool."""

    system_prompt = SYSTEM_PROMPT

    def __init__(self, config: CodeConfig, sandbox: SandboxPool | None) -> None:
        self.config = config
        self.pool = require_pool(sandbox, "code")
        problems = load_problems(config.problems_file)
        if config.verify is not None:
            problems = tuple(p for p in problems if p.verify == config.verify)
        if config.problem_ids is not None:
            unknown = set(config.problem_ids) - {p.id for p in problems}
            if unknown:
                raise ValueError(f"unknown problem ids: {sorted(unknown)}")
            problems = tuple(p for p in problems if p.id in config.problem_ids)
        if not problems:
            raise ValueError("no problems match the configuration")
        self.problems = problems
        self.problem: CodeProblem | None = None
        self.attempts = 0

    async def areset(self, seed: int | None = None) -> ResetResult:
        rng = random.Random(seed)
        self.problem = self.problems[rng.randrange(len(self.problems))]
        self.attempts = 0
        return self.problem.prompt, {"problem_id": self.problem.id, "verify": self.problem.verify}

    async def astep(self, action: Any) -> StepResult:
        problem = self.problem
        if problem is None:
            raise EnvStateError("code: step() before reset() or after the episode ended")
        self.attempts += 1
        async with open_session(self.pool) as sb:
            evaluation = await evaluate(
                sb, problem, extract_code(str(action)), self.config.timeout_s
            )
        info: dict[str, Any] = {
            "outcome": evaluation.outcome.name.lower(),
            "tests_passed": evaluation.passed,
            "tests_total": len(problem.tests),
            "attempt": self.attempts,
        }
        reward = grade(evaluation, self.config.reward, len(problem.tests))
        passed = evaluation.outcome is Outcome.PASSED
        last = self.attempts >= self.config.max_attempts
        if passed or last:
            self.problem = None
            truncated = not passed and self.config.max_attempts > 1
            if truncated:
                info["truncated_by"] = "max_attempts"
            observation = (
                "All tests passed."
                if passed
                else feedback(problem, evaluation, self.config.reveal_expected)
            )
            return observation, reward, not truncated, truncated, info
        return feedback(problem, evaluation, self.config.reveal_expected), 0.0, False, False, info


@spec_config(CodeConfig)
def make_code_env(sandbox: SandboxPool | None = None, **kwargs: Any) -> CodeEnv:
    """Registry factory for ``code@{...}``; kwargs are CodeConfig fields."""
    return CodeEnv(CodeConfig(**kwargs), sandbox)
