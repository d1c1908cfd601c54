"""What bash evaluates in a launch script without running a program (:mod:`fitrl.config.shell`):
``[ ... ]`` and ``[[ ... ]]``, glob patterns (``case``, ``${A//x/y}``, ``${A%x}``) and
``$(( ... ))``.

Tests are three-valued: True, False, or None when only running would tell (a file test, a
command's status, a value the script leaves to its environment)."""

from __future__ import annotations

import ast
import operator
import re
from typing import Optional


# ---- tests: [ ... ] and [[ ... ]] ------------------------------------------------------------

Arg = Optional[str]  # an argument's text, None when only running would tell
UNARY = {"-z", "-n", "-v"} | {f"-{c}" for c in "abcdefghkprstuwxGLNOS"}


def test_expr(args: list[Arg], double: bool, is_set=lambda name: None) -> Optional[bool]:
    """bash's ``test`` (``[``) or ``[[`` over expanded arguments; ``is_set`` answers ``-v NAME``."""
    pos = 0

    def peek() -> Arg:
        return args[pos] if pos < len(args) else ""

    def chain(ops: tuple[str, str], combine, operand) -> Optional[bool]:
        """``operand (op operand)*``, combined left to right (every operand is read: no short cut)."""
        nonlocal pos
        value = operand()
        while pos < len(args) and args[pos] in ops:
            pos += 1
            value = combine(value, operand())
        return value

    def or_() -> Optional[bool]:
        return chain(("||", "-o"), _or, and_)

    def and_() -> Optional[bool]:
        return chain(("&&", "-a"), _and, not_)

    def not_() -> Optional[bool]:
        nonlocal pos
        if peek() == "!" and pos + 1 < len(args):
            pos += 1
            v = not_()
            return None if v is None else not v
        return primary()

    def primary() -> Optional[bool]:
        nonlocal pos
        a = peek()
        if a == "(" and pos + 1 < len(args):
            pos += 1
            v = or_()
            pos += 1  # )
            return v
        if a in UNARY and pos + 1 < len(args) and args[pos + 1] not in BINARY:
            arg = args[pos + 1]
            pos += 2
            if a == "-v":
                return is_set(arg) if arg is not None else None
            if arg is None or a not in ("-z", "-n"):
                return None  # a file test: only running would tell
            return (arg == "") == (a == "-z")
        if pos + 2 < len(args) + 1 and pos + 1 < len(args) and args[pos + 1] in BINARY:
            left, op, right = a, args[pos + 1], args[pos + 2] if pos + 2 < len(args) else ""
            pos += 3
            return _binary(left, op, right, double)
        pos += 1
        return None if a is None else a != ""

    try:
        value = or_()
    except (ValueError, IndexError, re.error):  # ([ abc -eq 1 ], [[ x =~ ( ]]: bash's error: not guessed)
        return None
    return value if pos >= len(args) else None  # ([ -eq 3 ]: bash's "too many arguments" or "unary operator expected")


BINARY = {"=", "==", "!=", "<", ">", "=~", "-eq", "-ne", "-lt", "-le", "-gt", "-ge", "-nt", "-ot", "-ef"}


def _binary(left: Arg, op: str, right: Arg, double: bool) -> Optional[bool]:
    if left is None or right is None or op in ("-nt", "-ot", "-ef"):
        return None
    if op in ("=", "==", "!="):
        same = glob_match(left, right) if double else left == right
        return same if op != "!=" else not same
    if op == "=~":
        return re.search(right, left) is not None
    if op in ("<", ">"):
        return (left < right) if op == "<" else (left > right)
    a, b = int(left.strip()), int(right.strip())
    return {"-eq": a == b, "-ne": a != b, "-lt": a < b, "-le": a <= b, "-gt": a > b, "-ge": a >= b}[op]


def _and(a: Optional[bool], b: Optional[bool]) -> Optional[bool]:
    return False if a is False or b is False else (None if a is None or b is None else True)


def _or(a: Optional[bool], b: Optional[bool]) -> Optional[bool]:
    return True if a is True or b is True else (None if a is None or b is None else False)


# ---- glob patterns -------------------------------------------------------------------------

def glob_regex(pattern: str) -> str:
    """A bash glob as a regular expression (``*``, ``?``, ``[...]``, ``[!...]``; the rest literal)."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out += ".*"
        elif c == "?":
            out += "."
        elif c == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out += "[" + ("^" + body[1:] if body[:1] in "!^" and body else body).replace("\\", "\\\\") + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return out


def glob_match(text: str, pattern: str) -> bool:
    return re.fullmatch(glob_regex(pattern), text, re.S) is not None


def trim(text: str, pattern: str, op: str) -> str:
    """``${A#p}``, ``${A##p}`` (shortest, longest prefix), ``${A%p}``, ``${A%%p}`` (suffix)."""
    rx = re.compile(glob_regex(pattern), re.S)
    cuts = range(len(text) + 1)
    if op in ("#", "##"):
        for i in (reversed(cuts) if op == "##" else cuts):
            if rx.fullmatch(text[:i]):
                return text[i:]
    else:
        for i in (cuts if op == "%%" else reversed(cuts)):
            if rx.fullmatch(text[i:]):
                return text[:i]
    return text


def replace(text: str, pattern: str, new: str, op: str) -> str:
    """``${A/p/r}`` (the first), ``${A//p/r}`` (every), ``${A/#p/r}``, ``${A/%p/r}`` (anchored)."""
    if not pattern:
        return text
    rx = glob_regex(pattern)
    rx = {"/#": "^" + rx, "/%": rx + "$"}.get(op, rx)
    return re.sub(rx, lambda m: new, text, count=0 if op == "//" else 1, flags=re.S)


# ---- arithmetic ----------------------------------------------------------------------------

def _c_div(a: int, b: int) -> int:
    """C's division, toward zero (bash's), not Python's floor."""
    return abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)


def _power(a: int, b: int) -> int:
    if b < 0:
        raise ValueError("exponent less than 0")  # (bash refuses it too)
    return pow(a, b, 1 << 64)  # (bash wraps at 64 bits: never a number too large to hold)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: _power,
        ast.LShift: lambda a, b: a << (b & 63), ast.RShift: lambda a, b: a >> (b & 63),
        ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor,
        ast.Div: _c_div, ast.Mod: lambda a, b: a - b * _c_div(a, b)}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


def arith_eval(node: ast.AST) -> int:
    """bash's integer arithmetic on a parsed expression (names already replaced by numbers)."""
    if isinstance(node, ast.Expression):
        return arith_eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _int64(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _int64(_OPS[type(node.op)](arith_eval(node.left), arith_eval(node.right)))
    if isinstance(node, ast.UnaryOp):
        v = arith_eval(node.operand)
        return _int64({ast.USub: -v, ast.UAdd: v, ast.Invert: ~v, ast.Not: int(not v)}[type(node.op)])
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
        return int(_CMP[type(node.ops[0])](arith_eval(node.left), arith_eval(node.comparators[0])))
    if isinstance(node, ast.BoolOp):
        values = [arith_eval(v) for v in node.values]
        return int(all(values) if isinstance(node.op, ast.And) else any(values))
    if isinstance(node, ast.IfExp):
        return arith_eval(node.body) if arith_eval(node.test) else arith_eval(node.orelse)
    raise ValueError("not integer arithmetic")


def _int64(v: int) -> int:
    """``v`` as bash's signed 64-bit integer holds it (it wraps around)."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)
