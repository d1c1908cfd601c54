"""The lexer and arithmetic of :mod:`fitrl.config.shell`: a launch script's text as commands of
words, each word a list of parts (literal text, a variable with its operator, arithmetic, a
command substitution, ``~``), and ``$((...))`` evaluated with bash's integer rules."""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Optional

from fitrl.core.errors import ConfigError


# ---- lexing: commands of words, each word a list of parts --------------------------------------

@dataclass
class _Word:
    parts: list[tuple]
    """("lit", text, quoted) | ("var", name, op, _Word|None, quoted) | ("arith", text, quoted)
    | ("cmd", text, quoted) | ("tilde",)."""
    line: int


class _Lexer:
    STOPS = " \t\n;|&<>()"

    def __init__(self, text: str, name: str):
        self.text, self.name, self.pos = text, name, 0

    def line(self, pos: Optional[int] = None) -> int:
        return self.text.count("\n", 0, self.pos if pos is None else pos) + 1

    def unclosed(self, start: int, what: str) -> ConfigError:
        return ConfigError(f"{self.name}:{self.line(start)}: {what} opened here is never closed (bash stops here too)")

    def commands(self) -> list[tuple[int, list[_Word]]]:
        out, words, heredocs, text = [], [], [], self.text
        while self.pos < len(text):
            c = text[self.pos]
            if text.startswith("\\\n", self.pos):
                self.pos += 2
            elif c in " \t":
                self.pos += 1
            elif c == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif c in "<>" or text.startswith("&>", self.pos):
                op = re.match(r"&>>?|<<-?|<<<|<>|>>|>&|<&|>\||[<>]", text[self.pos:]).group(0)
                self.pos += len(op)
                while self.pos < len(text) and text[self.pos] in " \t":
                    self.pos += 1
                target = self.word()
                if op in ("<<", "<<-") and target is not None:
                    heredocs.append((_literal(target), op == "<<-"))
            elif c in "\n;|&()":
                if words:
                    out.append((words[0].line, words))
                words = []
                self.pos += 1
                if c == "\n" and heredocs:
                    self.skip_heredocs(heredocs)
                    heredocs = []
            else:
                start = self.pos
                w = self.word()
                if w is not None and self.pos < len(text) and text[self.pos] in "<>" and text[start:self.pos].isdigit():
                    continue  # 2>&1: the 2 is the redirection's, not a word
                if w is not None:
                    words.append(w)
        if words:
            out.append((words[0].line, words))
        return out

    def skip_heredocs(self, heredocs: list[tuple[str, bool]]) -> None:
        lines = self.text[self.pos:].split("\n")
        skipped = 0
        for delim, tabs in heredocs:
            while skipped < len(lines):
                body = lines[skipped]
                skipped += 1
                if (body.lstrip("\t") if tabs else body) == delim:
                    break
        self.pos += sum(len(s) + 1 for s in lines[:skipped])

    def word(self, stops: str = STOPS) -> Optional[_Word]:
        text, start = self.text, self.pos
        parts: list[tuple] = []
        buf = ""

        def flush():
            nonlocal buf
            if buf:
                parts.append(("lit", buf, False))
            buf = ""

        while self.pos < len(text) and text[self.pos] not in stops:
            c = text[self.pos]
            if c == "\\":
                if text.startswith("\\\n", self.pos):  # a line join inside a word: no space
                    self.pos += 2
                    continue
                flush()
                parts.append(("lit", text[self.pos + 1:self.pos + 2], True))
                self.pos += 2
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.unclosed(self.pos, "a single quote")
                flush()
                parts.append(("lit", text[self.pos + 1:end], True))
                self.pos = end + 1
            elif c == '"':
                flush()
                self.double(parts)
            elif c == "$" or c == "`":
                flush()
                self.dollar(parts, quoted=False)
            elif c == "~" and (self.pos == start or re.fullmatch(r"[A-Za-z_]\w*=", buf) and len(parts) == 0) \
                    and (self.pos + 1 >= len(text) or text[self.pos + 1] in "/" + stops):
                flush()
                parts.append(("tilde",))
                self.pos += 1
            else:
                buf += c
                self.pos += 1
        flush()
        return _Word(parts, self.line(start)) if self.pos > start else None

    def double(self, parts: list[tuple]) -> None:
        text, start, before = self.text, self.pos, len(parts)
        self.pos += 1
        buf = ""
        while True:
            if self.pos >= len(text):
                raise self.unclosed(start, "a double quote")
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                break
            if c == "\\" and self.pos + 1 < len(text) and text[self.pos + 1] in '$`"\\\n':
                buf += "" if text[self.pos + 1] == "\n" else text[self.pos + 1]
                self.pos += 2
            elif c in "$`":
                if buf:
                    parts.append(("lit", buf, True))
                buf = ""
                self.dollar(parts, quoted=True)
            else:
                buf += c
                self.pos += 1
        if buf or len(parts) == before:  # ("": an empty quoted word is still a word; "$@" is none)
            parts.append(("lit", buf, True))

    def closing(self, start: int, opener: str) -> int:
        """The index of the ``)`` (or ``` ` ```) closing what opens at ``start``."""
        text, i, depth = self.text, start, 0
        while i < len(text):
            c = text[i]
            if opener == "`":
                if c == "\\":
                    i += 2
                    continue
                if c == "`":
                    return i
            elif c == "\\":
                i += 2
                continue
            elif c == "'":
                j = text.find("'", i + 1)
                i = len(text) if j < 0 else j
            elif c == '"':
                j = i + 1
                while j < len(text) and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                i = j
            elif c == "(":
                depth += 1
            elif c == ")":
                if depth == 0:
                    return i
                depth -= 1
            i += 1
        raise self.unclosed(start - 1, "`" if opener == "`" else "$(")

    def dollar(self, parts: list[tuple], quoted: bool) -> None:
        text, p = self.text, self.pos
        if text[p] == "`":
            end = self.closing(p + 1, "`")
            parts.append(("cmd", text[p:end + 1], quoted))
            self.pos = end + 1
        elif text.startswith("$((", p):
            end = self.closing(p + 3, "(")
            if not text.startswith(")", end + 1):
                raise ConfigError(f"{self.name}:{self.line(p)}: $(( without its closing ))")
            parts.append(("arith", text[p + 3:end], quoted))
            self.pos = end + 2
        elif text.startswith("$(", p):
            end = self.closing(p + 2, "(")
            parts.append(("cmd", text[p:end + 1], quoted))
            self.pos = end + 1
        elif text.startswith("${", p):
            self.brace(parts, quoted)
        elif text.startswith("$'", p):
            end = text.find("'", p + 2)
            if end < 0:
                raise self.unclosed(p, "a $' quote")
            body = text[p + 2:end].replace("\\n", "\n").replace("\\t", "\t").replace("\\\\", "\\")
            parts.append(("lit", body, True))
            self.pos = end + 1
        else:
            m = re.match(r"[A-Za-z_]\w*|[0-9@*#?$!-]", text[p + 1:])
            if m is None:
                parts.append(("lit", "$", quoted))
                self.pos = p + 1
            else:
                parts.append(("var", m.group(0), "", None, quoted))
                self.pos = p + 1 + len(m.group(0))

    def brace(self, parts: list[tuple], quoted: bool) -> None:
        text, p = self.text, self.pos
        m = re.match(r"(#?)([A-Za-z_]\w*|\d+|[@*#?$!-])(:?[-=+?])?", text[p + 2:])
        if m and m.group(1) and not m.group(3) and text.startswith("}", p + 2 + m.end()):
            parts.append(("var", m.group(2), "len", None, quoted))
            self.pos = p + 2 + m.end() + 1
            return
        if m and not m.group(1):
            self.pos = p + 2 + m.end()
            arg = None
            if m.group(3):
                arg = self.word(stops="}") or _Word([], self.line())
            if text.startswith("}", self.pos):
                parts.append(("var", m.group(2), m.group(3) or "", arg, quoted))
                self.pos += 1
                return
        end, depth, i = None, 0, p + 2  # ${A%x}, ${A/x/y}, ${A:0:3}: kept as their text
        while i < len(text):
            if text.startswith("${", i):
                depth, i = depth + 1, i + 2
                continue
            if text[i] == "}":
                if depth == 0:
                    end = i
                    break
                depth -= 1
            i += 1
        if end is None:
            raise self.unclosed(p, "${")
        parts.append(("var", text[p:end + 1], "other", None, quoted))
        self.pos = end + 1


def _literal(word: _Word) -> str:
    return "".join(p[1] for p in word.parts if p[0] == "lit")


# ---- evaluation --------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Pow: operator.pow,
        ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor,
        ast.Div: lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1),  # C's: toward zero
        ast.Mod: lambda a, b: a - b * (abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1))}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


def _arith_eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _arith_eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return int(_OPS[type(node.op)](_arith_eval(node.left), _arith_eval(node.right)))
    if isinstance(node, ast.UnaryOp):
        v = _arith_eval(node.operand)
        return {ast.USub: -v, ast.UAdd: v, ast.Invert: ~v, ast.Not: int(not v)}[type(node.op)]
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
        return int(_CMP[type(node.ops[0])](_arith_eval(node.left), _arith_eval(node.comparators[0])))
    if isinstance(node, ast.BoolOp):
        values = [_arith_eval(v) for v in node.values]
        return int(all(values) if isinstance(node.op, ast.And) else any(values))
    raise ValueError("not integer arithmetic")
