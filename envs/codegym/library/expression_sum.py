"""CodeGym environment: evaluate arithmetic expressions with a calculator tool.

The calculator parses expressions with ``ast`` and allows only numbers and
arithmetic operators, so the agent cannot run code through it; it can still ask
for something huge (``9**9**9``), which the tool-call time limit catches.
"""

import ast
import operator

from codegym_runtime import CodeGymEnv, tool

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integers and + - * // % ** are allowed")


class ExpressionSum(CodeGymEnv):
    """Compute the sum of the values of several hidden integer expressions.
    Observe lists them; Calculate evaluates an expression; History shows what you calculated.
    Finish with Done(answer)."""

    CONFIGS = [
        {"expressions": ["3*4", "10-7", "2**5"]},
        {"expressions": ["(1+2)*(3+4)", "100//7"]},
        {"expressions": ["-5+2", "6%4", "7*7*7"]},
    ]

    def __init__(self, expressions: list):
        self.expressions = list(expressions)
        self.history = []

    def get_ref_answer(self):
        return sum(_evaluate(ast.parse(e, mode="eval")) for e in self.expressions)

    @tool
    def Observe(self) -> str:
        """List the expressions, separated by ';'."""
        return ";".join(self.expressions)

    @tool
    def Calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression (+ - * // % ** and parentheses).

        Args:
            expression: The expression, e.g. "(2+3)*4".
        """
        self.history.append(expression)  # recorded first: a call that times out must roll this back
        return str(_evaluate(ast.parse(expression, mode="eval")))

    @tool
    def History(self) -> str:
        """List the expressions calculated so far."""
        return ";".join(self.history) or "(none)"

    def solve(self):
        total = sum(int(self.Calculate(e)) for e in self.Observe().split(";"))
        return self.Done(str(total))
