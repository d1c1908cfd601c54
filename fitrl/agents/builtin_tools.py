"""The built-in tools: ``calculator`` and ``python`` (a code interpreter).

Both run in the sandbox's worker processes (fitrl/agents/sandbox.py), which bound their time,
memory, files and network; the functions here only compute. Their docstrings are their schemas
(fitrl/agents/tools.py): what the model is shown.
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 1000
"""``a ** b`` with ``|b|`` above this is refused: ``9 ** 9 ** 9`` would run for minutes in one C call."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and parentheses.
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def python(code: str) -> str:
    """Run Python code and return what it prints (and the value of its last line, if that is an expression).

    Args:
        code: The Python source to run. Each call starts with fresh variables; files may be written in the current directory only; there is no network.
    """
    tree = ast.parse(code, mode="exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):  # a REPL's habit: show the last expression
        last = ast.Expression(tree.body.pop().value)
    out = io.StringIO()
    scope: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        exec(compile(tree, "<tool>", "exec"), scope)
        if last is not None:
            value = eval(compile(last, "<tool>", "eval"), scope)
            if value is not None:
                print(repr(value))
    return out.getvalue()


BUILTIN_TOOLS = {"calculator": calculator, "python": python}
