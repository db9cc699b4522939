"""A calculator a model may call: arithmetic expressions evaluated safely in the worker.

`evaluate(expression)` reads the text with `ast` in ``eval`` mode and walks the tree itself;
nothing is ever passed to ``eval``. It accepts numbers (integers and decimals), ``+ - * / //
% **``, unary ``+``/``-`` and parentheses, and writes the multiplication and division signs and ``^`` as ``*``,
``/`` and ``**`` (what a model may copy from a question). Everything else (names, calls,
attributes, strings, comparisons: ``__import__('os')``) is refused. Work is bounded: the text
is at most `MAX_CHARS` characters, every number and every intermediate result at most
`MAX_ABS` in size (a power is refused before it is computed when its result would be larger,
so ``9**9**9`` costs nothing), and the nesting depth is capped, so no expression can take the
worker's memory or time. A refusal is a `CalculatorError` whose message is shown to the
model; `evaluate` raises nothing else.

Results print as integers when they are whole (``10/4`` is ``2.5``, ``10/2`` is ``5``) and
otherwise to 12 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_CHARS = 200
MAX_ABS = 10**40
MAX_DEPTH = 40
_SYMBOLS = str.maketrans(
    {"\u00d7": "*", "\u00f7": "/", "^": "**"}
)  # ^ as calculators read it, not xor

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why."""


def evaluate(expression: str) -> str:
    """The value of `expression` as text; `CalculatorError` for anything it refuses."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.translate(_SYMBOLS).strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"not an arithmetic expression: {text[:60]!r}") from None
    return _format(_value(tree.body, 0))


def _value(node: ast.expr, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"not a number: {node.value!r}"[:80])
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        apply = _BINARY.get(type(node.op))
        if apply is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        try:
            return _bounded(apply(left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {_what(node)}")


def _power(base: Number, exponent: Number) -> Number:
    """`base ** exponent`, refused before it is computed when the result would be too big."""
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if abs(base) > 1 and exponent * math.log10(abs(base)) > math.log10(MAX_ABS):
        raise CalculatorError(f"result larger than {MAX_ABS:.0e}")
    try:
        result = base**exponent
    except (OverflowError, ZeroDivisionError) as exc:
        raise CalculatorError(f"cannot compute the power: {exc}") from None
    if isinstance(result, complex):
        raise CalculatorError("the power has no real value")
    return result


def _bounded(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_ABS:
        raise CalculatorError(f"result larger than {MAX_ABS:.0e}")
    return value


def _format(value: Number) -> str:
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _what(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Name):
        return f"the name {node.id[:40]!r}"
    return type(node).__name__
