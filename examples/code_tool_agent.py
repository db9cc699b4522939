"""A plain OpenAI-SDK tool loop on the `code` environment's problems, with a `run_python` tool.

Nothing in `solve` knows about the farm except its arguments: the client comes from
`api.client_kwargs()` and the tool runs in a session of the worker's sandbox pool. Train it with

    agent@{"entry": "examples.code_tool_agent:solve", "use_sandbox": true,
           "task": {"problem_id": "sum-two"}}

on a worker started with `--sandbox-backend docker` (or `bwrap`). The reward is the `code`
environment's own grading of the final ```python block (1.0 when every test passes).
"""

from __future__ import annotations

import json
import random
from typing import Any

import openai

from envs.agent import OpenAIConfig
from envs.code.env import SYSTEM_PROMPT, grade
from envs.code.grading import evaluate, extract_code
from envs.code.problems import CodeProblem, load_problems
from envs.sandboxed import PythonSession, SandboxPool, open_session

RUN_PYTHON = {
    "type": "function",
    "function": {
        "name": "run_python",
        "description": "Run a Python program and return its stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    },
}
TOOL_TIMEOUT_S = 5.0


def pick_problem(task: dict[str, Any] | None, seed: int) -> CodeProblem:
    """The task's `problem_id`, or a problem drawn with the episode's seed."""
    problems = load_problems((task or {}).get("problems_file"))
    wanted = (task or {}).get("problem_id")
    if wanted is not None:
        return next(p for p in problems if p.id == wanted)
    return random.Random(seed).choice(problems)


async def run_python(sb: PythonSession, arguments: str) -> str:
    """The tool: run `code` from the call's JSON arguments in the sandbox session."""
    try:
        code = json.loads(arguments)["code"]
    except (ValueError, KeyError, TypeError):
        return 'error: arguments must be {"code": "..."}'
    result = await sb.run_python(str(code), timeout=TOOL_TIMEOUT_S)
    return f"exit code {result.exit_code}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-2000:]}"


async def solve(
    task: dict[str, Any] | None, api: OpenAIConfig, sandbox: SandboxPool
) -> dict[str, Any]:
    problem = pick_problem(task, api.seed)
    rounds = int((task or {}).get("max_rounds", 4))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT + " You may test code with run_python."},
        {"role": "user", "content": problem.prompt},
    ]
    tool_calls = 0
    async with open_session(sandbox) as sb, openai.AsyncOpenAI(**api.client_kwargs()) as client:
        for _ in range(rounds):
            reply = await client.chat.completions.create(
                model=api.model, messages=messages, tools=[RUN_PYTHON], max_tokens=256
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                tool_calls += 1
                output = await run_python(sb, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        answer = next(
            (m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"), ""
        )
        evaluation = await evaluate(sb, problem, extract_code(answer), TOOL_TIMEOUT_S)
    reward = grade(evaluation, "binary", len(problem.tests))
    return {
        "reward": reward,
        "metrics": {"tests_passed": evaluation.passed, "tool_calls": tool_calls},
    }
