"""Running a candidate solution against a problem's tests, inside the sandbox.

Each test is its own sandbox process, so a crash, a hang or a bomb in one test
cannot forge another's result. Assertion tests print a completion marker carrying
a nonce that the host passes on stdin (not in the code), so a solution that exits
early with status 0 does not pass. The outcome ranks as CodeRL does:
compile error, then runtime error (any test; limit violations count here), then
a failing test, then all tests passing. After a limit violation the remaining
tests are skipped: their outcome cannot improve the grade and would only burn time.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from envs.code.problems import CodeProblem, normalise_output
from envs.sandboxed import PythonSession, violated, violation_name

if TYPE_CHECKING:
    from sandbox.result import RunResult

_COMPILE = "import sys\ncompile(sys.stdin.read(), 'solution.py', 'exec')\n"
_ASSERT_HARNESS = """\
import sys as _sys
_nonce = _sys.stdin.readline().strip()
_g = {"__name__": "solution", "__builtins__": __builtins__}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _g)
try:
    exec(compile(open("test_case.py").read(), "test_case.py", "exec"), _g)
except AssertionError:
    _sys.stdout.write("\\nFAIL:" + _nonce + "\\n")
    _sys.stdout.flush()
    _sys.exit(3)
_sys.stdout.write("\\nPASS:" + _nonce + "\\n")
"""
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


class Outcome(enum.IntEnum):
    """Ordered so that the worst outcome of all tests is the ``min``."""

    COMPILE_ERROR = 0
    RUNTIME_ERROR = 1
    FAILED = 2
    PASSED = 3


@dataclass(frozen=True)
class CaseResult:
    outcome: Outcome
    detail: str  # short, model-facing ("wrong output", "timeout", stderr tail)
    stdout: str = ""


@dataclass(frozen=True)
class Evaluation:
    outcome: Outcome  # the worst over all tests
    results: tuple[CaseResult, ...] = field(default=())
    compile_detail: str = ""

    @property
    def passed(self) -> int:
        return sum(r.outcome is Outcome.PASSED for r in self.results)


def extract_code(action: str) -> str:
    """The last fenced Python block of the action, or the whole action."""
    blocks = _FENCE.findall(action)
    return blocks[-1] if blocks else action


def _tail(text: str, lines: int = 3, limit: int = 300) -> str:
    """The last lines of an error output (the exception), capped."""
    text = "\n".join(text.strip().splitlines()[-lines:])
    return text if len(text) <= limit else "..." + text[-limit:]


def _failure(result: RunResult) -> CaseResult | None:
    if violated(result):
        return CaseResult(Outcome.RUNTIME_ERROR, f"{violation_name(result)} limit exceeded")
    if result.exit_code != 0:
        return CaseResult(
            Outcome.RUNTIME_ERROR, _tail(result.stderr) or f"exit code {result.exit_code}"
        )
    return None


async def _run_test(
    sb: PythonSession, problem: CodeProblem, index: int, code: str, limit_s: float
) -> CaseResult:
    if problem.verify == "execution":
        result = await sb.run_python(code, stdin=problem.stdin, timeout=limit_s)
        return _failure(result) or CaseResult(Outcome.PASSED, "ran cleanly", result.stdout)
    test = problem.tests[index]
    if problem.verify == "stdio":
        result = await sb.run_python(code, stdin=test.input, timeout=limit_s)
        failure = _failure(result)
        if failure:
            return failure
        ok = normalise_output(result.stdout) == normalise_output(test.output or "")
        return CaseResult(
            Outcome.PASSED if ok else Outcome.FAILED,
            "passed" if ok else "wrong output",
            result.stdout,
        )
    nonce = secrets.token_hex(16)
    files = {"solution.py": code, "test_case.py": test.assertion or ""}
    result = await sb.run_python(_ASSERT_HARNESS, stdin=nonce + "\n", files=files, timeout=limit_s)
    if f"FAIL:{nonce}" in result.stdout and result.exit_code == 3 and not violated(result):
        return CaseResult(Outcome.FAILED, "assertion failed")
    failure = _failure(result)
    if failure:
        return failure
    if f"PASS:{nonce}" not in result.stdout:
        return CaseResult(Outcome.RUNTIME_ERROR, "exited before the test finished")
    return CaseResult(Outcome.PASSED, "passed")


async def evaluate(
    sb: PythonSession, problem: CodeProblem, code: str, limit_s: float
) -> Evaluation:
    """Compile-check ``code`` then run every test in session ``sb``."""
    check = await sb.run_python(_COMPILE, stdin=code, files={"solution.py": code}, timeout=limit_s)
    if violated(check) or check.exit_code != 0:
        detail = _tail(check.stderr) or violation_name(check)
        return Evaluation(Outcome.COMPILE_ERROR, (), detail)
    results: list[CaseResult] = []
    count = 1 if problem.verify == "execution" else len(problem.tests)
    for index in range(count):
        result = await _run_test(sb, problem, index, code, limit_s)
        results.append(result)
        if result.outcome is Outcome.RUNTIME_ERROR and "limit exceeded" in result.detail:
            break
    return Evaluation(min(r.outcome for r in results), tuple(results))
