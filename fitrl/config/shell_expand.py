"""Word expansion for :mod:`fitrl.config.shell`: a word's parts (:mod:`fitrl.config.shell_lex`)
to the text bash would produce, over the variables the script has set so far.

What only running would tell is never guessed: the environment of the import process is not read
(a variable the script does not set is ``${NAME}`` in the value), and ``$(command)``, backticks,
``~`` and the script's own arguments stay as their text. Each such value carries what it holds
(:attr:`Value.unknown`) so the importer can say which key it feeds. In a test (``[ -z "$A" ]``,
``case "$A" in``) a variable the script does not set reads as unset, as the script's own
``${A:-default}`` does, and is listed among the defaulted."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Optional, Union

from fitrl.config.shell_eval import arith_eval, replace, trim
from fitrl.config.shell_lex import Arith, ArrayLit, Lexer, Lit, Part, Subst, Tilde, Var, Word


@dataclass(frozen=True)
class Value:
    text: str
    """The text bash would produce, with what is unknown left as its own text (``${N_GPUS}``)."""
    unknown: tuple[str, ...] = ()
    """What in ``text`` only running would tell: ``$N_GPUS``, ``$(date +%s)``, ``~``, ``$1``, or
    ``?<what decides it>`` for a value set on a path of the script fitrl cannot choose."""


@dataclass(frozen=True)
class Arr:
    """An array variable (``A=(x y)``)."""
    items: tuple[Value, ...]


def unique(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _placeholder(unknown: str) -> Optional[str]:
    """The text an unknown stands as in a value (None: it marks the whole value)."""
    if unknown.startswith("?"):
        return None
    if re.fullmatch(r"\$[A-Za-z_]\w*|\$\d+", unknown):
        return "${" + unknown[1:] + "}"
    return unknown


def _split(v: Value) -> list[tuple[str, list[str]]]:
    """An unquoted value's fields, split on white space outside the unknowns' placeholders
    (``$(date +%s)`` stays one), each with the unknowns it holds."""
    spans = []
    for u in v.unknown:
        ph = _placeholder(u)
        if ph:
            spans += [(m.start(), m.end(), u) for m in re.finditer(re.escape(ph), v.text)]
    # an unknown whose placeholder is not in the text (``${#A}``, ``$((A + 1))``) marks every field,
    # so that no field loses what it depends on
    whole = [u for u in v.unknown if not any(s[2] == u for s in spans)]
    out, start, i = [], None, 0
    while i <= len(v.text):
        inside = next((s for s in spans if s[0] <= i < s[1]), None)
        if inside is not None:
            start = i if start is None else start
            i = inside[1]
            continue
        if i == len(v.text) or v.text[i].isspace():
            if start is not None:
                holds = [u for s, e, u in spans if start <= s < i]
                out.append((v.text[start:i], list(unique(whole + holds))))
                start = None
        elif start is None:
            start = i
        i += 1
    return out


def joined_values(values, sep: str = " ") -> Value:
    values = list(values)
    return Value(sep.join(v.text for v in values), unique(u for v in values for u in v.unknown))


class Expander:
    def __init__(self, path, name: str):
        self.path, self.name = path, name
        self.vars: dict[str, Union[Value, Arr]] = {}
        self.args: Optional[list[Value]] = None
        """The arguments of the function being called; None at the script's level (not known)."""
        self.defaulted: list[str] = []  # variables the script does not set whose ${A:-default} was used
        self.passes_args = False  # "$@" of the script in the command being read
        self.test_mode = False  # in a test or a case word: a variable the script does not set is unset

    # -- assignments

    @staticmethod
    def assignment(word: Word) -> bool:
        p = word.parts[0] if word.parts else None
        return isinstance(p, Lit) and not p.quoted and bool(re.match(r"[A-Za-z_]\w*(\[[^\]=]*\])?\+?=", p.text))

    def assign(self, word: Word) -> None:
        head = word.parts[0].text
        target, _, rest = head.partition("=")
        append = target.endswith("+")
        target = target.rstrip("+")
        element = re.fullmatch(r"(\w+)\[(.*)\]", target)
        name = element.group(1) if element else target
        old = self.vars.get(name)
        if len(word.parts) > 1 and isinstance(word.parts[1], ArrayLit) and not rest:
            items = tuple(f for w in word.parts[1].items for f in self.fields(w))
            before = old.items if isinstance(old, Arr) else ((old,) if isinstance(old, Value) else ())
            self.vars[name] = Arr((before if append else ()) + items)
            return
        value = self.joined(Word((Lit(rest, True), *word.parts[1:]), word.line))
        if element:
            items = list(old.items if isinstance(old, Arr) else ((old,) if old is not None else ()))
            i = self.arith(element.group(2))
            if i.unknown or not i.text.lstrip("-").isdigit():
                self.vars[name] = Arr(tuple(items) + (value,))
                return
            k = int(i.text)
            items += [Value("")] * (k + 1 - len(items))
            items[k] = joined_values([items[k], value], "") if append else value
            self.vars[name] = Arr(tuple(items))
            return
        if append:
            base = old.items[0] if isinstance(old, Arr) and old.items else (old if isinstance(old, Value) else Value(""))
            value = joined_values([base, value], "")
        self.vars[name] = value

    # -- words

    def joined(self, word: Word) -> Value:
        """A word without field splitting (an assignment's value, a ${A:-default}'s default)."""
        return joined_values((self.part(p) for p in word.parts), "")

    def fields(self, word: Word) -> list[Value]:
        """The fields a word becomes: unquoted expansions split on white space, as bash does;
        ``"$@"`` and ``"${A[@]}"`` one field per item."""
        out: list[Value] = []
        text, unknown, have = "", [], False

        def push():
            nonlocal text, unknown, have
            if have:
                out.append(Value(text, unique(unknown)))
            text, unknown, have = "", [], False

        def add(v: Value, quoted: bool):
            nonlocal text, unknown, have
            if quoted:
                text, unknown, have = text + v.text, unknown + list(v.unknown), True
                return
            if v.text[:1].isspace():
                push()
            for n, (piece, holds) in enumerate(_split(v)):
                if n:
                    push()
                text, unknown, have = text + piece, unknown + holds, True
            if v.text[-1:].isspace():
                push()

        for p in word.parts:
            quoted = getattr(p, "quoted", False) or (isinstance(p, Lit) and p.quoted)
            items = self.items(p)
            if items is None:
                # (an arithmetic result is one number, known or not: never split)
                add(self.part(p), isinstance(p, (Lit, Arith)) or quoted)
                continue
            for n, item in enumerate(items):
                if n and quoted:
                    push()
                add(item, quoted)
        push()
        return out

    def items(self, p: Part) -> Optional[list[Value]]:
        """The values of ``$@`` or ``${A[@]}`` (None: ``p`` is one value)."""
        if not isinstance(p, Var) or p.op != "":
            return None
        if p.index is None and p.name in "@*":
            if self.args is None:
                self.passes_args = True  # (no arguments: "$@" is no word at all)
                return []
            return list(self.args) if p.name == "@" or not p.quoted else [joined_values(self.args)]
        if p.index in ("@", "*"):
            raw = self.vars.get(p.name)
            values = list(raw.items) if isinstance(raw, Arr) else ([raw] if raw is not None else [])
            return values if p.index == "@" or not p.quoted else [joined_values(values)]
        return None

    def part(self, p: Part) -> Value:
        if isinstance(p, Lit):
            return Value(p.text)
        if isinstance(p, Tilde):
            home = self.vars.get("HOME")
            return home if isinstance(home, Value) else Value("~", ("~",))
        if isinstance(p, Subst):
            return Value(p.text, (p.text,))
        if isinstance(p, Arith):
            return self.arith(p.text)
        if isinstance(p, ArrayLit):
            return joined_values(f for w in p.items for f in self.fields(w))
        return self.variable(p)

    def lookup(self, name: str, index: Optional[str]) -> Optional[Value]:
        raw = self.vars.get(name)
        if name.isdigit() and self.args is not None:
            k = int(name)
            raw = self.args[k - 1] if 0 < k <= len(self.args) else None
        if isinstance(raw, Arr):
            if index in ("@", "*"):
                return joined_values(raw.items)
            i = self.arith(index) if index is not None else Value("0")
            if i.unknown or not i.text.lstrip("-").isdigit():
                return Value(f"${{{name}[{index}]}}", i.unknown or (f"${name}",))
            k = int(i.text)
            return raw.items[k] if -len(raw.items) <= k < len(raw.items) else None
        if raw is not None and index not in (None, "@", "*", "0"):
            return None
        return raw

    def variable(self, p: Var) -> Value:
        name, op = p.name, p.op
        if op == "other":
            return Value(name, (name,))
        if name == "0":
            return Value(str(self.path))
        if name == "#":
            return Value(str(len(self.args)) if self.args is not None else "0")  # (run with no arguments)
        if name in "@*":
            return joined_values(self.args) if self.args is not None else Value("")
        if name in "?$!-":
            return Value(f"${name}", (f"${name}",))
        v = self.lookup(name, p.index)
        if op == "len":
            raw = self.vars.get(name)
            if p.index in ("@", "*"):
                return Value(str(len(raw.items) if isinstance(raw, Arr) else int(raw is not None)))
            if v is not None and not v.unknown:
                return Value(str(len(v.text)))
            return Value(f"${{#{name}}}", v.unknown if v is not None else (f"${name}",))
        is_set = v is not None
        full = is_set and (v.text != "" or bool(v.unknown))
        if op in (":-", "-", ":=", "="):
            if full if op.startswith(":") else is_set:
                return v
            if not name.isdigit() and name not in self.vars:
                self.defaulted.append(name)
            default = self.joined(p.arg)
            if op.endswith("=") and not name.isdigit():
                self.vars[name] = default
            return default
        if op in (":+", "+"):
            return self.joined(p.arg) if (full if op.startswith(":") else is_set) else Value("")
        if not is_set and (name in self.vars or name.isdigit() and self.args is not None):
            return Value("")  # (an element the script's array lacks, a function's missing $3: nothing, as in bash)
        if not is_set:
            if self.test_mode and not name.isdigit():
                self.defaulted.append(name)
                return Value("")
            return Value(f"${{{name}}}", (f"${name}",))  # (":?" and plain: unknown)
        if op in ("", ":?", "?") or v.unknown:
            return v
        return self.transform(v, p)

    def transform(self, v: Value, p: Var) -> Value:
        """``${A/x/y}``, ``${A#x}``, ``${A%x}``, ``${A:1:2}``, ``${A^^}`` on a known value."""
        op = p.op
        pattern = self.joined(p.arg) if p.arg is not None else Value("")
        other = self.joined(p.arg2) if p.arg2 is not None else Value("")
        if pattern.unknown or other.unknown:
            return Value(v.text, pattern.unknown + other.unknown)
        if op.startswith("/"):
            return Value(replace(v.text, pattern.text, other.text, op))
        if op in ("#", "##", "%", "%%"):
            return Value(trim(v.text, pattern.text, op))
        if op == ":":
            start = self.arith(pattern.text or "0")
            length = self.arith(other.text) if p.arg2 is not None else Value(str(len(v.text)))
            if start.unknown or length.unknown:
                return Value(v.text, start.unknown + length.unknown)
            s = int(start.text) if int(start.text) >= 0 else max(0, len(v.text) + int(start.text))
            n = int(length.text)
            return Value(v.text[s:s + n] if n >= 0 else v.text[s:len(v.text) + n])
        case = {"^^": str.upper, ",,": str.lower, "^": lambda t: t[:1].upper() + t[1:],
                ",": lambda t: t[:1].lower() + t[1:]}
        return Value(case[op](v.text))

    def arith(self, expr: str) -> Value:
        """``$(( ... ))``: bash's 64-bit integer arithmetic over the script's variables. An
        assignment (``i = 1``, ``i++``, ``i += 2``) sets its variable, as bash does."""
        m = _ARITH_SET.fullmatch(expr)
        if m and (m.group(1) or m.group(3)) and not (m.group(1) and m.group(3)):
            pre, name, op, rhs = m.group(1), m.group(2), m.group(3), m.group(4)
            if (pre or op in ("++", "--")) and rhs:
                return Value(f"$(({expr}))", (f"$(({expr}))",))
            step = pre or op
            old = self.arith(name)
            new = self.arith(rhs) if op == "=" else self.arith(
                f"{name} {step[0]} 1" if step in ("++", "--") else f"{name} {op[:-1]} ({rhs})")
            if new.unknown:  # (the variable and the value read as the expression, naming what is unknown)
                new = Value(f"$(({expr}))", new.unknown)
            self.vars[name] = new
            return old if op in ("++", "--") and not old.unknown else new
        raw = f"$(({expr}))"
        inner = self.joined(Lexer(expr, self.name).word(stops="") or Word((), 0))
        unknown: list[str] = list(inner.unknown)

        def names(text: str, depth: int) -> str:  # a variable's value is itself an expression
            def one(m: re.Match) -> str:
                if m.group(0)[0].isdigit():
                    return str(_number(m.group(0)))
                v = self.lookup(m.group(0), None)
                if v is None or v.unknown or depth > 8:
                    unknown.extend(v.unknown if v is not None and v.unknown else [f"${m.group(0)}"])
                    return "0"
                return f"({names(v.text, depth + 1)})"
            return re.sub(rf"{_NUMBER}|[A-Za-z_]\w*", one, text)

        try:
            text = names(inner.text, 0)
        except ValueError:  # (08: bash refuses a digit beyond its base too)
            return Value(raw, unique(unknown + [raw]))
        if re.search(r"[A-Za-z_]\w*\s*(\+\+|--)|(\+\+|--)\s*[A-Za-z_]", inner.text):
            unknown.append(raw)  # (an increment inside a larger expression: not followed)
        text = text.replace("&&", " and ").replace("||", " or ")
        text = re.sub(r"!(?!=)", " not ", text)
        text = re.sub(r"(.+?)\?(.+?):(.+)", r"(\2) if (\1) else (\3)", text)  # a ? b : c
        if not unknown:
            try:
                return Value(str(arith_eval(ast.parse(text.strip() or "0", mode="eval"))))
            except (SyntaxError, ValueError, ZeroDivisionError, KeyError, TypeError, RecursionError):
                unknown.append(raw)
        return Value(raw, unique(unknown))


# i = 1, i += 2, i++, ++i: an arithmetic expression that assigns (``==`` and ``<=`` do not)
_ARITH_SET = re.compile(r"\s*(\+\+|--)?\s*([A-Za-z_]\w*)\s*(\+\+|--|(?:[-+*/%&|^]|<<|>>)?=(?!=))?\s*(.*?)\s*",
                        re.S)
_NUMBER = r"0[xX][0-9a-fA-F]+|\d+#[0-9A-Za-z@_]+|\d+"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ@_"


def _number(text: str) -> int:
    """A bash integer constant: ``0x1f`` (hex), ``017`` (octal), ``2#101`` (base 2 to 64)."""
    if text[:2] in ("0x", "0X"):
        return int(text, 16)
    if "#" in text:
        base, digits = text.split("#", 1)
        base = int(base)
        if not 2 <= base <= 64:
            raise ValueError(text)
        if base <= 36:
            return int(digits, base)
        value = 0
        for d in digits:
            if _DIGITS.index(d) >= base:
                raise ValueError(text)
            value = value * base + _DIGITS.index(d)
        return value
    return int(text, 8) if len(text) > 1 and text[0] == "0" else int(text)
