"""The ``calc`` environment: arithmetic too hard to do in the head, with a calculator tool.

Built for a real chat model (SmolLM2-135M-Instruct) to learn to use a tool over several
turns. The first observation asks a question (``"What is 347*28?"``). The model may call the
calculator (`envs.calculator`); the result comes back as a ``tool`` message, which the chat
template renders as a ``<tool_response>``; the model then answers. A turn with no call is the
answer and ends the episode: reward 1 when the last number it says is the right one
(``"9716"``, ``"The answer is 9,716."``) and, with ``require_tool`` (the default), a
calculator call succeeded earlier in the episode, else 0. A malformed call or an expression the calculator refuses is an error observation
(``ErrorCategory.FORMAT``) and the episode goes on; after ``max_turns`` actions it is
truncated with reward 0.

How a call is written is the ``style``:

- ``hermes``: the tool's schema goes to the chat template (SmolLM2's converted template puts
  it in the system message, Hermes style) and calls are ``<tool_call>{"name": "calculator",
  "arguments": {"expression": "347*28"}}</tool_call>``, read by the run's tool parser;
- ``hermes_example``: the same, with one whole worked exchange in the system prompt;
- ``tag``: no schema; the system prompt teaches ``<calc>347*28</calc>``, which this
  environment reads from the text itself.

``shots`` worked exchanges (a question, the call, its result, the bare answer) come first, as
earlier turns of the conversation. Why the defaults (``hermes``, instructions, two shots,
3-digit by 2-digit products): on SmolLM2 at temperature 1 (`python -m bench tooltask`,
docs/envs.md), with no shots (in any style) or one the base model never called the tool;
with two Hermes shots it calls in about a quarter of the episodes and succeeds
in about one in seven (14%), and a right call nearly always led to a right answer, so what RL has to
teach is the call itself. The ``<calc>`` tag with two shots already succeeds in three of four:
little left to learn.

Where the calculator runs is the ``calculator`` setting. ``sandbox`` (what `farm demo` trains
with) runs each call in a session of the worker's sandbox pool, as every tool environment
here runs its tools: the calculator's own source and the call's expression go in as one
Python program, so the model sees the same results either way; a sandbox that fails is an
`EnvInfraError` (the worker retries the episode, the model is not blamed). ``worker`` (the
default, for runs without a pool) evaluates in the worker's process, which is safe for this
tool alone: `envs.calculator` walks the expression's syntax tree and never calls ``eval``.
A call costs tens of milliseconds in a warm bubblewrap jail (29 ms in one check on a busy
machine, not a benchmark), nothing beside a turn's generation.

Splits: ``heldout_size`` problems are drawn once from a fixed seed (`SPLIT_SEED`); they are
the ``heldout`` split and never drawn for ``train``. Both depend only on ``problems`` and
``heldout_size``, so ``calc`` and ``calc@{"split": "heldout"}`` name disjoint problems. A task
row ``{"index": i}`` names the split's i-th problem (held-out only: the train split is drawn
by seed); `split_lines` is the eval file that scores each held-out problem once.
"""

from __future__ import annotations

import functools
import inspect
import json
import random
import re
from typing import Any, Literal

import pydantic

from broker.messages import ErrorCategory
from envs import calculator as calculator_module
from envs.api import Env, ResetResult, StepResult
from envs.calculator import CalculatorError, evaluate
from envs.errors import EnvSpecError, EnvStateError
from envs.parsing import ParsedAction, parse_tool_calls
from envs.registry import spec_config
from envs.sandboxed import SandboxPool, open_session, require_pool, violated, violation_name
from envs.tools import ToolCall
from envs.toy import TRAILING_SPECIALS

SPLIT_SEED = 41  # fixed for ever: changing it moves problems between the splits
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_TAG = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPERANDS: dict[str, tuple[tuple[int, int], ...]] = {  # (low, high) of each operand
    "mul2x2": ((10, 99), (10, 99)),
    "mul3x2": ((100, 999), (10, 99)),
    "add3x3": ((100, 999), (100, 999), (100, 999)),
}
Problem = tuple[int, ...]

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "for example 12*34 or 5+6"}
            },
            "required": ["expression"],
        },
    },
}
_ASK = "Use the calculator tool, then answer with the number."
_EXAMPLE = (
    "\n\nExample:\nuser: What is 12*34?\nassistant: <tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
    "user: <tool_response>\n408\n</tool_response>\nassistant: 408"
)
_TAG_PROMPT = (
    "You have a calculator. To use it, write the expression between <calc> and </calc>, for "
    "example <calc>12*34</calc>, and stop. The result comes back as a <tool_response>. Then "
    "answer with the number."
)
SYSTEM_PROMPTS = {"hermes": _ASK, "hermes_example": _ASK + _EXAMPLE, "tag": _TAG_PROMPT}
_CALLS = {
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>',
    "tag": "<calc>%s</calc>",
}


class CalcConfig(pydantic.BaseModel):
    """Configuration of the calc environment."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    split: Literal["train", "heldout"] = pydantic.Field(
        "train", description="which problems: the training split or the held-out one"
    )
    problems: Literal["mul2x2", "mul3x2", "add3x3"] = pydantic.Field(
        "mul3x2", description="a 2-digit by 2-digit or 3- by 2-digit product, or three 3-digit sum"
    )
    style: Literal["hermes", "hermes_example", "tag"] = pydantic.Field(
        "hermes", description="how a tool call is written (module docstring)"
    )
    heldout_size: int = pydantic.Field(40, ge=1, le=1000, description="problems held out")
    require_tool: bool = pydantic.Field(
        True, description="a right answer scores only after a successful calculator call"
    )
    instructions: bool = pydantic.Field(
        True, description="hermes: a system prompt asking for the tool (else SmolLM2's default)"
    )
    shots: int = pydantic.Field(
        2, ge=0, le=4, description="worked exchanges (call, result, answer) before the question"
    )
    max_turns: int = pydantic.Field(
        3, ge=1, le=16, description="actions before the episode is truncated"
    )
    calculator: Literal["worker", "sandbox"] = pydantic.Field(
        "worker", description="where a call is evaluated: in the worker, or in a sandbox session"
    )


@functools.lru_cache(maxsize=16)
def heldout_problems(problems: str, heldout_size: int) -> tuple[Problem, ...]:
    """The held-out problems, in a fixed order: drawn once from `SPLIT_SEED`, no repeats."""
    rng = random.Random(f"{SPLIT_SEED}/{problems}")
    chosen: dict[Problem, None] = {}
    while len(chosen) < heldout_size:
        chosen[_draw(rng, problems)] = None
    return tuple(chosen)


def _draw(rng: random.Random, problems: str) -> Problem:
    return tuple(rng.randint(low, high) for low, high in _OPERANDS[problems])


def question(problem: Problem, problems: str) -> str:
    symbol = "*" if problems.startswith("mul") else "+"
    return f"What is {symbol.join(map(str, problem))}?"


@functools.lru_cache(maxsize=32)
def shots(problems: str, style: str, count: int) -> tuple[dict[str, str], ...]:
    """`count` worked exchanges, as earlier turns of the conversation: a question, the call in
    `style`'s syntax, its result and the bare answer. Drawn from a seed of their own and never
    a held-out problem (the held-out split of any size is a prefix of the 1000 drawn here); the
    same in every episode, so the prompt's prefix is shared."""
    rng, held = (
        random.Random(f"{SPLIT_SEED}/shots/{problems}"),
        set(heldout_problems(problems, 1000)),
    )
    messages: list[dict[str, str]] = []
    while len(messages) < 4 * count:
        problem = _draw(rng, problems)
        if problem in held:
            continue
        ask, result = question(problem, problems), str(answer_of(problem, problems))
        call = _CALLS["tag" if style == "tag" else "hermes"] % ask[8:-1]
        messages += [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result},
        ]
    return tuple(messages)


def answer_of(problem: Problem, problems: str) -> int:
    if problems.startswith("mul"):
        return functools.reduce(lambda a, b: a * b, problem)
    return sum(problem)


def final_number(reply: str) -> int | None:
    """The last number the reply says (``9,716`` is 9716), or None."""
    numbers = _NUMBER.findall(TRAILING_SPECIALS.sub("", reply))
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return int(value) if value.is_integer() else None


class CalcEnv(Env):
    """One arithmetic question, a calculator, and the answer; see the module docstring."""

    def __init__(
        self, config: CalcConfig | None = None, sandbox: SandboxPool | None = None
    ) -> None:
        self.config = config or CalcConfig()
        c = self.config
        self.pool = require_pool(sandbox, "calc") if c.calculator == "sandbox" else None
        self.heldout = heldout_problems(c.problems, c.heldout_size)
        plain = c.style == "hermes" and not c.instructions
        self.system_prompt = None if plain else SYSTEM_PROMPTS[c.style]
        self.tools = None if c.style == "tag" else [CALCULATOR_SCHEMA]
        self._answer: int | None = None
        self._turns = 0
        self._used_tool = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ResetResult:
        c = self.config
        row = (options or {}).get("row")
        if row is not None:
            if c.split != "heldout":
                raise EnvSpecError("calc: a row names a held-out problem; the train split draws")
            problem = self.heldout[_index(row, len(self.heldout))]
        elif c.split == "heldout":
            problem = random.Random(seed).choice(self.heldout)
        else:
            problem = self._train_problem(seed)
        self._answer, self._turns, self._used_tool = answer_of(problem, c.problems), 0, False
        info = {"split": c.split, "problem": question(problem, c.problems)[8:-1]}
        ask = {"role": "user", "content": question(problem, c.problems)}
        return [*shots(c.problems, c.style, c.shots), ask], info

    def _train_problem(self, seed: int | None) -> Problem:
        rng, held = random.Random(seed), set(self.heldout)
        while True:  # the held-out problems are a sliver of the space: a redraw is rare
            problem = _draw(rng, self.config.problems)
            if problem not in held:
                return problem

    def step(self, action: Any) -> StepResult:
        if self.pool is not None:
            raise EnvStateError("calc: its calculator runs in the sandbox; step it with astep()")
        parsed, info, ended = self._turn(action)
        if ended is not None:
            return ended
        return self._observe(parsed, [_calculate(call) for call in parsed.calls], info)

    async def astep(self, action: Any) -> StepResult:
        if self.pool is None:
            return self.step(action)
        parsed, info, ended = self._turn(action)
        if ended is not None:
            return ended
        results = []
        if parsed.calls and parsed.error is None:  # one session for the turn's calls
            async with open_session(self.pool) as sb:
                for call in parsed.calls:
                    results.append(await _calculate_in(sb, call))
        return self._observe(parsed, results, info)

    def _turn(self, action: Any) -> tuple[ParsedAction, dict[str, Any], StepResult | None]:
        """Count and read the action; a turn without a call is the answer, which ends the
        episode (its result is returned last); otherwise the calls are the caller's to run."""
        if self._answer is None:
            raise EnvStateError("calc: step() called before reset() or after the episode ended")
        self._turns += 1
        parsed = self._parse(action)
        info: dict[str, Any] = {"answer": str(self._answer)}
        if parsed.error is None and not parsed.calls:  # no call: this is the answer
            said = final_number(parsed.content if self.config.style != "tag" else str(action))
            correct = said == self._answer and (self._used_tool or not self.config.require_tool)
            self._answer = None
            info.update(correct=correct, used_tool=self._used_tool, said=_text(said))
            return parsed, info, ("", 1.0 if correct else 0.0, True, False, info)
        return parsed, info, None

    def _observe(
        self, parsed: ParsedAction, results: list[tuple[str, str | None]], info: dict[str, Any]
    ) -> StepResult:
        """The turn's tool messages from each call's (result, error); the episode is
        truncated after `max_turns` actions."""
        observation = self._tool_messages(parsed, results, info)
        if self._turns >= self.config.max_turns:
            self._answer = None
            return observation, 0.0, False, True, {**info, "truncated_by": "max_turns"}
        return observation, 0.0, False, False, info

    def _parse(self, action: Any) -> ParsedAction:
        if self.config.style != "tag":
            return parse_tool_calls(action)
        text = TRAILING_SPECIALS.sub("", str(action))
        calls = tuple(ToolCall("calculator", {"expression": e.strip()}) for e in _TAG.findall(text))
        error = "unbalanced <calc> ... </calc>" if not calls and "<calc>" in text else None
        return ParsedAction(calls, text.strip(), error, "tag")

    def _tool_messages(
        self, parsed: ParsedAction, results: list[tuple[str, str | None]], info: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Each call's result (or error) as a tool message; errors mark the step FORMAT."""
        if parsed.error is not None:
            info.update(error=ErrorCategory.FORMAT, error_detail=parsed.error[:500])
            return [_tool_message(f"Error: {parsed.error}", "")]
        messages = []
        for call, (result, error) in zip(parsed.calls, results, strict=True):
            if error is None:
                self._used_tool = True
            else:
                result = f"Error: {error}"
                info.update(error=ErrorCategory.FORMAT, error_detail=error[:500])
            messages.append(_tool_message(result, call.id))
        info["tool_results"] = [m["content"] for m in messages]
        return messages


def _calculate(call: ToolCall) -> tuple[str, str | None]:
    """(the value, None) or ("", why the calculator refused)."""
    try:
        return evaluate(_expression(call)), None
    except CalculatorError as exc:
        return "", str(exc)


# The sandbox runs the calculator's own module source, then this: one JSON line out.
_SANDBOX_MAIN = """
import json as _json
try:
    _out = {"value": evaluate(%r)}
except CalculatorError as _exc:
    _out = {"error": str(_exc)}
print(_json.dumps(_out))
"""
SANDBOX_CALL_TIMEOUT_S = 10.0  # the calculator bounds its own work; this is a backstop


@functools.cache
def _calculator_source() -> str:
    return inspect.getsource(calculator_module)


async def _calculate_in(sb: Any, call: ToolCall) -> tuple[str, str | None]:
    """`_calculate` in the sandbox session `sb`. The name and arguments are checked here
    (only an expression goes in); a run that breaks a sandbox limit or prints no verdict
    is reported to the model as an error, as the worker's calculator reports a refusal."""
    try:
        expression = _expression(call)
    except CalculatorError as exc:
        return "", str(exc)
    if not isinstance(expression, str):
        return "", f"the expression must be text, got {type(expression).__name__}"
    code = _calculator_source() + _SANDBOX_MAIN % expression
    result = await sb.run_python(code, timeout=SANDBOX_CALL_TIMEOUT_S)
    if violated(result):
        return "", f"the calculator was stopped ({violation_name(result)})"
    try:
        verdict = json.loads(result.stdout.strip().splitlines()[-1])
        return (str(verdict["value"]), None) if "value" in verdict else ("", str(verdict["error"]))
    except (IndexError, ValueError, KeyError, TypeError):
        return "", f"the calculator failed: {result.stderr.strip()[-300:] or 'no output'}"


def _expression(call: ToolCall) -> str:
    if call.name != "calculator":
        raise CalculatorError(f"unknown tool {call.name!r}; the tool is calculator")
    args = call.arguments
    if not isinstance(args, dict) or set(args) != {"expression"}:
        raise CalculatorError('calculator takes one argument: {"expression": "..."}')
    return args["expression"]


def _text(number: int | None) -> str | None:
    return None if number is None else str(number)


def _tool_message(content: str, call_id: str) -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": "calculator"}


def _index(row: Any, count: int) -> int:
    index = row.get("index") if isinstance(row, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise EnvSpecError(
            f"calc: a row names a problem as {{'index': 0..{count - 1}}}, got {row!r}"
        )
    return index


def split_lines(**kwargs: Any) -> list[str]:
    """A task file (JSONL lines) naming every held-out problem once, by its index; `kwargs`
    are the other `CalcConfig` fields. ``--eval-tasks heldout=FILE`` then scores each once."""
    config = CalcConfig(**kwargs | {"split": "heldout"})
    spec = "calc@" + json.dumps(config.model_dump(exclude_defaults=True) | {"split": "heldout"})
    return [json.dumps({"env_spec": spec, "row": {"index": i}}) for i in range(config.heldout_size)]


@spec_config(CalcConfig)
def make_calc(sandbox: SandboxPool | None = None, **kwargs: Any) -> CalcEnv:
    """Registry factory for ``calc@{"split": "train", "problems": "mul3x2", "style": "hermes",
    "instructions": true, "shots": 2, "heldout_size": 40, "require_tool": true, "max_turns": 3,
    "calculator": "worker"}``; ``calculator: "sandbox"`` needs the worker's `sandbox` pool."""
    return CalcEnv(CalcConfig(**kwargs), sandbox)
