"""The lexer of :mod:`fitrl.config.shell`: a launch script's text as commands of words, each
command with the operator that ends it (``;``, ``&&``, ``||``, ``|``, ``;;``, ``(``, ``)``, a
newline), each word a list of parts: literal text, a variable with its operator, arithmetic, a
command substitution, ``~``, an array literal. ``[[ ... ]]`` and ``(( ... ))`` are read as bash
reads them (their ``&&``, ``<`` and parentheses are words, not operators)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

from fitrl.core.errors import ConfigError


# ---- parts of a word ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Text:
    """A part that is a piece of text; its class says which kind (a literal, arithmetic, a command)."""
    text: str
    quoted: bool = False


class Lit(_Text):
    """Literal text."""


@dataclass(frozen=True)
class Var:
    """``$A``, ``${A}``, ``${A:-x}``, ``${A[@]}``, ``${A//x/y}``, ``${#A}``: ``op`` names the form
    (``""``, ``:-`` ... , ``len``, ``/``, ``//``, ``#``, ``%%``, ``:`` (substring), ``^^``, or
    ``other`` for a form not read, whose ``name`` is then its whole text)."""
    name: str
    op: str = ""
    arg: Optional["Word"] = None
    arg2: Optional["Word"] = None
    index: Optional[str] = None
    """``[@]``, ``[*]``, ``[0]``: an array subscript's text."""
    quoted: bool = False


class Arith(_Text):
    """``$(( expression ))``, or a ``(( expression ))`` command (a C-style ``for``'s too): the expression's text."""


class Subst(_Text):
    """``$(command)`` or a backtick command: its text, never run."""


@dataclass(frozen=True)
class Tilde:
    quoted: bool = False


@dataclass(frozen=True)
class ArrayLit:
    """``NAME=(a b c)``: the words of the array."""
    items: tuple["Word", ...]
    quoted: bool = False


Part = Union[Lit, Var, Arith, Subst, Tilde, ArrayLit]


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    line: int

    def literal(self) -> Optional[str]:
        """The word's text when it is one unquoted literal (a keyword, an operator), else None."""
        if len(self.parts) == 1 and isinstance(self.parts[0], Lit) and not self.parts[0].quoted:
            return self.parts[0].text
        return None


@dataclass
class Cmd:
    line: int
    words: list[Word]
    end: str
    """The operator after it: ``\\n``, ``;``, ``;;``, ``&``, ``&&``, ``|``, ``||``, ``(``, ``)`` or ``""``."""
    source: str = ""
    """Its text in the script (for the lines that name a condition)."""
    arith: bool = field(default=False)
    """An arithmetic command, ``(( ... ))``: its one word is the expression."""


# the keywords after which a command starts: `if [[ ... ]]`, `while (( ... ))` are a test and arithmetic
LEADING = {"if", "elif", "while", "until", "!", "then", "do", "else", "{", "time"}


def lead(words: list["Word"]) -> bool:
    """Whether the next word starts a command (no words yet, or only keywords)."""
    return all(w.literal() in LEADING for w in words)


ASSIGN = re.compile(r"[A-Za-z_]\w*(\[[^\]]*\])?\+?=")


class Lexer:
    STOPS = " \t\n;|&<>()"

    def __init__(self, text: str, name: str):
        self.text, self.name, self.pos = text, name, 0

    def line(self, pos: Optional[int] = None) -> int:
        return self.text.count("\n", 0, self.pos if pos is None else pos) + 1

    def unclosed(self, start: int, what: str) -> ConfigError:
        return ConfigError(f"{self.name}:{self.line(start)}: {what} opened here is never closed (bash stops here too)")

    def commands(self) -> list[Cmd]:
        out: list[Cmd] = []
        words: list[Word] = []
        heredocs: list[tuple[str, bool]] = []
        text, start, arith = self.text, self.pos, False

        def emit(end: str, upto: int) -> None:
            nonlocal words, arith
            if words or end in ("(", ")", ";;"):
                line = words[0].line if words else self.line()
                out.append(Cmd(line, words, end, text[start:upto].strip(), arith))
            words, arith = [], False

        while self.pos < len(text):
            c = text[self.pos]
            if not words:
                start = self.pos if c not in " \t" else start
            if text.startswith("\\\n", self.pos):
                self.pos += 2
            elif c in " \t":
                self.pos += 1
            elif c == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif lead(words) and re.match(r"\[\[[ \t\n]", text[self.pos:]):
                words += self.condition_words()
            elif text.startswith("((", self.pos) and (lead(words) or [w.literal() for w in words] == ["for"]):
                close = self.closing(self.pos + 2, "(", "((")
                if not text.startswith(")", close + 1):
                    raise ConfigError(f"{self.name}:{self.line()}: (( without its closing ))")
                words.append(Word((Arith(text[self.pos + 2:close]),), self.line()))
                arith = lead(words[:-1])
                self.pos = close + 2
            elif c in "<>" or text.startswith("&>", self.pos):
                op = re.match(r"&>>?|<<-?|<<<|<>|>>|>&|<&|>\||[<>]", text[self.pos:]).group(0)
                self.pos += len(op)
                while self.pos < len(text) and text[self.pos] in " \t":
                    self.pos += 1
                target = self.word()
                if op in ("<<", "<<-") and target is not None:
                    heredocs.append(("".join(p.text for p in target.parts if isinstance(p, Lit)), op == "<<-"))
            elif c in "\n;|&()":
                op = re.match(r";;&?|;&|&&|\|\||\|&|[\n;|&()]", text[self.pos:]).group(0)
                self.pos += len(op)
                emit({";&": ";;", ";;&": ";;", "|&": "|"}.get(op, op), self.pos - len(op))
                if op == "\n" and heredocs:
                    self.skip_heredocs(heredocs)
                    heredocs = []
            else:
                at = self.pos
                w = self.word()
                if w is not None and self.pos < len(text) and text[self.pos] in "<>" and text[at:self.pos].isdigit():
                    continue  # 2>&1: the 2 is the redirection's, not a word
                if w is not None:
                    words.append(w)
        emit("", self.pos)
        return out

    def condition_words(self) -> list[Word]:
        """``[[ ... ]]``: its words up to ``]]``, operators included as words."""
        text, start = self.text, self.pos
        words = [Word((Lit("[["),), self.line())]
        self.pos += 2
        while True:
            while self.pos < len(text) and (text[self.pos] in " \t\n" or text.startswith("\\\n", self.pos)):
                self.pos += 2 if text[self.pos] == "\\" else 1
            if self.pos >= len(text):
                raise self.unclosed(start, "[[")
            op = re.match(r"&&|\|\||!=|[()<>]|!(?=[ \t\n])", text[self.pos:])
            if op:
                words.append(Word((Lit(op.group(0)),), self.line()))
                self.pos += len(op.group(0))
                continue
            w = self.word(stops=" \t\n();")  # (`]]; then`: the ; ends the word)
            if w is None:
                raise self.unclosed(start, "[[")
            words.append(w)
            if w.literal() == "]]":
                return words

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

    def word(self, stops: str = STOPS) -> Optional[Word]:
        text, start = self.text, self.pos
        parts: list[Part] = []
        buf = ""

        def flush():
            nonlocal buf
            if buf:
                parts.append(Lit(buf))
            buf = ""

        while self.pos < len(text):
            c = text[self.pos]
            if c == "(" and not parts and ASSIGN.fullmatch(buf) and stops == self.STOPS:
                self.pos += 1  # NAME=( ... ): an array
                flush()
                parts.append(self.array())
                continue
            if c in stops:
                break
            if c == "\\":
                if text.startswith("\\\n", self.pos):  # a line join inside a word: no space
                    self.pos += 2
                    continue
                flush()
                parts.append(Lit(text[self.pos + 1:self.pos + 2], True))
                self.pos += 2
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise self.unclosed(self.pos, "a single quote")
                flush()
                parts.append(Lit(text[self.pos + 1:end], True))
                self.pos = end + 1
            elif c == '"':
                flush()
                self.double(parts)
            elif c == "$" or c == "`":
                flush()
                self.dollar(parts, quoted=False)
            elif c == "~" and (self.pos == start or ASSIGN.fullmatch(buf) and not parts) \
                    and (self.pos + 1 >= len(text) or text[self.pos + 1] in "/" + stops):
                flush()
                parts.append(Tilde())
                self.pos += 1
            else:
                buf += c
                self.pos += 1
        flush()
        return Word(tuple(parts), self.line(start)) if self.pos > start else None

    def array(self) -> ArrayLit:
        """The words of ``NAME=( ... )`` (comments and newlines between them skipped)."""
        text, start, items = self.text, self.pos - 1, []
        while True:
            while self.pos < len(text) and text[self.pos] in " \t\n":
                self.pos += 1
            if text.startswith("\\\n", self.pos):
                self.pos += 2
                continue
            if self.pos >= len(text):
                raise self.unclosed(start, "an array's (")
            if text[self.pos] == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
                continue
            if text[self.pos] == ")":
                self.pos += 1
                return ArrayLit(tuple(items))
            w = self.word(stops=" \t\n)")
            if w is None:
                raise self.unclosed(start, "an array's (")
            items.append(w)

    def double(self, parts: list[Part]) -> None:
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
                    parts.append(Lit(buf, True))
                buf = ""
                self.dollar(parts, quoted=True)
            else:
                buf += c
                self.pos += 1
        if buf or len(parts) == before:  # ("": an empty quoted word is still a word; "$@" is none)
            parts.append(Lit(buf, True))

    def closing(self, start: int, opener: str, what: str = "$(") -> int:
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
        raise self.unclosed(start - 1, "`" if opener == "`" else what)

    def dollar(self, parts: list[Part], quoted: bool) -> None:
        text, p = self.text, self.pos
        if text[p] == "`":
            end = self.closing(p + 1, "`")
            parts.append(Subst(text[p:end + 1], quoted))
            self.pos = end + 1
        elif text.startswith("$((", p):
            end = self.closing(p + 3, "(", "$((")
            if not text.startswith(")", end + 1):
                raise ConfigError(f"{self.name}:{self.line(p)}: $(( without its closing ))")
            parts.append(Arith(text[p + 3:end], quoted))
            self.pos = end + 2
        elif text.startswith("$(", p):
            end = self.closing(p + 2, "(")
            parts.append(Subst(text[p:end + 1], quoted))
            self.pos = end + 1
        elif text.startswith("${", p):
            parts.append(self.brace(quoted))
        elif text.startswith("$'", p):
            end = text.find("'", p + 2)
            if end < 0:
                raise self.unclosed(p, "a $' quote")
            body = text[p + 2:end].replace("\\n", "\n").replace("\\t", "\t").replace("\\\\", "\\")
            parts.append(Lit(body, True))
            self.pos = end + 1
        else:
            m = re.match(r"[A-Za-z_]\w*|[0-9@*#?$!-]", text[p + 1:])
            if m is None:
                parts.append(Lit("$", quoted))
                self.pos = p + 1
            else:
                parts.append(Var(m.group(0), quoted=quoted))
                self.pos = p + 1 + len(m.group(0))

    def brace(self, quoted: bool) -> Var:
        text, p = self.text, self.pos
        m = re.match(r"(#?)([A-Za-z_]\w*|\d+|[@*#?$!-])(\[[^\]]*\])?", text[p + 2:])
        if m:
            name, index = m.group(2), m.group(3)[1:-1] if m.group(3) else None
            self.pos = p + 2 + m.end()
            if m.group(1):  # ${#A}, ${#A[@]}
                if text.startswith("}", self.pos):
                    self.pos += 1
                    return Var(name, "len", index=index, quoted=quoted)
            else:
                var = self.operator(name, index, quoted)
                if var is not None:
                    return var
        end, depth, i = None, 0, p + 2  # a form not read: kept as its text
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
        self.pos = end + 1
        return Var(text[p:end + 1], "other", quoted=quoted)

    def operator(self, name: str, index: Optional[str], quoted: bool) -> Optional[Var]:
        """What follows ``${NAME``: ``}``, or an operator and its words, then ``}``."""
        text = self.text
        op = re.match(r"\}|:?[-=+?]|//|/#|/%|/|##|#|%%|%|\^\^|\^|,,|,|:", text[self.pos:])
        if op is None:
            return None
        op = op.group(0)
        self.pos += len(op)
        arg = arg2 = None
        if op == "}":
            return Var(name, index=index, quoted=quoted)
        if op.startswith("/"):
            arg = self.word(stops="/}") or Word((), self.line())
            if text.startswith("/", self.pos):
                self.pos += 1
                arg2 = self.word(stops="}") or Word((), self.line())
        elif op == ":":
            arg = self.word(stops=":}") or Word((), self.line())
            if text.startswith(":", self.pos):
                self.pos += 1
                arg2 = self.word(stops="}") or Word((), self.line())
        elif op not in ("^^", "^", ",,", ","):
            arg = self.word(stops="}") or Word((), self.line())
        if not text.startswith("}", self.pos):
            return None
        self.pos += 1
        return Var(name, op, arg, arg2, index, quoted)
