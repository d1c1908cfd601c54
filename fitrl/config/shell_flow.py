"""The control flow of a launch script (:mod:`fitrl.config.shell`): its commands
(:mod:`fitrl.config.shell_lex`) parsed into ``if``/``elif``/``else``, ``for`` (over words or
arithmetic), ``while``/``until``, ``case``, functions, ``{ ... }`` and ``( ... )`` groups and
``&&``/``||`` lists. What bash evaluates of them without running a program is in
:mod:`fitrl.config.shell_eval`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from fitrl.config.shell_lex import Arith, Cmd, Word
from fitrl.core.errors import ConfigError


# ---- nodes ---------------------------------------------------------------------------------

@dataclass
class Simple:
    cmd: Cmd


@dataclass
class AndOr:
    """``a && b || c``: the first node, then each (operator, node)."""
    first: "Node"
    rest: list[tuple[str, "Node"]]


@dataclass
class Not:
    node: "Node"


@dataclass
class If:
    line: int
    arms: list[tuple[list["Node"], list["Node"], str]]
    """(condition, body, the condition's text) for ``if`` and each ``elif``."""
    orelse: Optional[list["Node"]]


@dataclass
class For:
    line: int
    var: str
    words: Optional[list[Word]]
    """None: ``for x; do`` (over the arguments)."""
    body: list["Node"]
    source: str = ""


@dataclass
class Loop:
    """``while``/``until`` (``cond`` the condition's commands) or ``for (( init; test; step ))``."""
    line: int
    kind: str
    cond: list["Node"]
    body: list["Node"]
    source: str = ""
    arith: Optional[tuple[str, str, str]] = None


@dataclass
class Case:
    line: int
    word: Word
    arms: list[tuple[list[Word], list["Node"]]]
    source: str = ""


@dataclass
class Func:
    name: str
    body: "Node"


@dataclass
class Group:
    body: list["Node"]
    subshell: bool = False


Node = Union[Simple, AndOr, Not, If, For, Loop, Case, Func, Group]

KEYWORDS = {"if", "then", "elif", "else", "fi", "for", "select", "while", "until", "do", "done", "case", "esac",
            "{", "}", "!", "function", "time"}
HEADERS = {"for", "select", "case", "function"}  # the words after these are the construct's, not commands


# ---- parsing -------------------------------------------------------------------------------

@dataclass
class _Tok:
    kw: Optional[str]
    cmd: Cmd
    """A keyword's own command (its ``end`` and line), or the command itself."""


def _tokens(cmds: list[Cmd]) -> list[_Tok]:
    """Each command with its leading keywords split off (``then echo x`` is ``then``, ``echo x``):
    the last keyword of a command that is nothing else keeps the command's ending operator."""
    out = []
    for cmd in cmds:
        words, kws = list(cmd.words), []
        while words and words[0].literal() in KEYWORDS:
            kw = words.pop(0).literal()
            kws.append((kw, [words.pop(0)] if kw == "function" and words else []))
            if kw in HEADERS - {"function"}:
                break
        source = " ".join(cmd.source.replace("\\\n", " ").split())  # (one line, for the lines naming it)
        for j, (kw, own) in enumerate(kws):
            last = j == len(kws) - 1 and not words
            out.append(_Tok(kw, Cmd(cmd.line, own, cmd.end if last else "", cmd.source)))
            # (the rest's text without the keyword: a condition is named as `if [ -f x ]`, not `if if ...`)
            source = re.sub(rf"^{re.escape(kw)}\s+" + (r"\S+\s*" if own else ""), "", source)
        if words or (not kws and (cmd.end in ("(", ")", ";;") or cmd.arith)):
            out.append(_Tok(None, Cmd(cmd.line, words, cmd.end, source, cmd.arith)))
    return out


class Parser:
    def __init__(self, cmds: list[Cmd], name: str):
        self.toks, self.i, self.name = _tokens(cmds), 0, name

    def parse(self) -> list[Node]:
        nodes, _ = self.body(set())
        if self.i < len(self.toks):
            tok = self.toks[self.i]
            raise ConfigError(f"{self.name}:{tok.cmd.line}: `{tok.kw or tok.cmd.source}` where bash expects a command "
                              f"(bash stops here too)")
        return nodes

    def peek(self) -> Optional[_Tok]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, kw: str, opened: str, line: int) -> _Tok:
        tok = self.peek()
        if tok is None or tok.kw != kw:
            raise ConfigError(f"{self.name}:{line}: `{opened}` opened here has no `{kw}` (bash stops here too)")
        self.i += 1
        return tok

    def body(self, stops: set[str], until_end: str = "") -> tuple[list[Node], str]:
        """Commands up to a keyword in ``stops`` (not taken), or through one ending in ``until_end``."""
        nodes: list[Node] = []
        while True:
            tok = self.peek()
            if tok is None or (tok.kw in stops):
                return nodes, ""
            if tok.kw in ("then", "elif", "else", "fi", "do", "done", "esac", "}") and tok.kw not in stops:
                raise ConfigError(f"{self.name}:{tok.cmd.line}: `{tok.kw}` without what opens it (bash stops here too)")
            node, end = self.and_or()
            nodes.append(node)
            if until_end and end == until_end:
                return nodes, end

    def and_or(self) -> tuple[Node, str]:
        node, end = self.command()
        rest = []
        while end in ("&&", "||") and self.peek() is not None:
            op = end
            nxt, end = self.command()
            rest.append((op, nxt))
        return (AndOr(node, rest) if rest else node), end

    def command(self) -> tuple[Node, str]:
        if self.i >= len(self.toks):  # (`!`, `time` or `f()` last in the script)
            line = self.toks[-1].cmd.line if self.toks else 1
            raise ConfigError(f"{self.name}:{line}: the script ends where bash expects a command (bash stops here too)")
        tok = self.toks[self.i]
        self.i += 1
        kw, cmd = tok.kw, tok.cmd
        if kw == "!":
            node, end = self.command()
            return Not(node), end
        if kw == "time":
            return self.command()
        if kw == "if":
            return self.if_(cmd.line)
        if kw in ("for", "select"):
            return self.for_(cmd)
        if kw in ("while", "until"):
            cond, _ = self.body({"do"})
            self.take("do", kw, cmd.line)
            body, _ = self.body({"done"})
            done = self.take("done", kw, cmd.line)
            return Loop(cmd.line, kw, cond, body, f"{kw} {source_text(cond)}"), done.cmd.end
        if kw == "case":
            return self.case(cmd)
        if kw == "{":
            body, _ = self.body({"}"})
            close = self.take("}", "{", cmd.line)
            return Group(body), close.cmd.end
        if kw == "function":  # function f { ... }, function f() { ... }
            name = cmd.words[0].literal() if cmd.words else None
            nxt = self.peek()
            if nxt is not None and nxt.kw is None and not nxt.cmd.words and nxt.cmd.end in ("(", ")"):
                self.i += 1
                if nxt.cmd.end == "(" and self.peek() is not None and self.peek().cmd.end == ")":
                    self.i += 1
            return self.function(name, cmd)
        if not cmd.words and cmd.end == "(":  # ( ... ): a subshell
            body, _ = self.body(set(), until_end=")")
            return Group(body, subshell=True), ""
        nxt = self.peek()
        if cmd.end == "(" and len(cmd.words) == 1 and nxt is not None and not nxt.cmd.words and nxt.cmd.end == ")":
            self.i += 1  # name() { ... }
            return self.function(cmd.words[0].literal(), cmd)
        return Simple(cmd), cmd.end

    def function(self, name: Optional[str], head: Cmd) -> tuple[Node, str]:
        if not name or self.peek() is None:
            raise ConfigError(f"{self.name}:{head.line}: a function without a name or a body (bash stops here too)")
        body, end = self.command()
        return Func(name, body), end

    def if_(self, line: int) -> tuple[Node, str]:
        arms, orelse, opened = [], None, "if"
        while True:
            cond, _ = self.body({"then"})
            self.take("then", opened, line)
            body, _ = self.body({"elif", "else", "fi"})
            arms.append((cond, body, source_text(cond)))
            tok = self.peek()
            if tok is None:
                raise ConfigError(f"{self.name}:{line}: `if` opened here has no `fi` (bash stops here too)")
            self.i += 1
            if tok.kw == "elif":
                opened = "elif"
                continue
            if tok.kw == "else":
                orelse, _ = self.body({"fi"})
                tok = self.take("fi", "if", line)
            return If(line, arms, orelse), tok.cmd.end

    def for_(self, head: Cmd) -> tuple[Node, str]:
        tok = self.peek()
        if tok is None or tok.kw is not None:
            raise ConfigError(f"{self.name}:{head.line}: `for` without its variable (bash stops here too)")
        self.i += 1
        words = tok.cmd.words
        arith = words[0].parts[0].text if len(words) == 1 and isinstance(words[0].parts[0], Arith) else None
        self.take("do", "for", head.line)
        body, _ = self.body({"done"})
        done = self.take("done", "for", head.line)
        if arith is not None:
            init, test, step = (arith.split(";") + ["", ""])[:3]
            return Loop(head.line, "for", [], body, f"for (({arith}))", (init, test, step)), done.cmd.end
        var = words[0].literal() if words else None
        if var is None or not re.fullmatch(r"[A-Za-z_]\w*", var):
            raise ConfigError(f"{self.name}:{head.line}: `for` without a variable name (bash stops here too)")
        values = words[2:] if len(words) > 1 and words[1].literal() == "in" else None
        return For(head.line, var, values, body, f"for {tok.cmd.source}"), done.cmd.end

    def case(self, head: Cmd) -> tuple[Node, str]:
        tok = self.peek()
        self.i += 1
        words = tok.cmd.words if tok is not None and tok.kw is None else []
        if len(words) < 2 or words[1].literal() != "in":
            raise ConfigError(f"{self.name}:{head.line}: `case` without `WORD in` (bash stops here too)")
        arms: list[tuple[list[Word], list[Node]]] = []
        patterns, end = list(words[2:]), tok.cmd.end
        while True:
            while end != ")":  # the patterns of an arm: a | b | c )
                nxt = self.peek()
                if nxt is None:
                    raise ConfigError(f"{self.name}:{head.line}: `case` opened here has no `esac` (bash stops here too)")
                if nxt.kw == "esac" and not patterns:
                    self.i += 1
                    return Case(head.line, words[0], arms, f"case {tok.cmd.source}"), nxt.cmd.end
                self.i += 1
                patterns += nxt.cmd.words
                end = nxt.cmd.end
            body, _ = self.body({"esac"}, until_end=";;")
            arms.append(([p for p in patterns if p.literal() != "("], body))
            patterns, end = [], ""


def source_text(nodes: list[Node]) -> str:
    """The text of a condition, for the lines that name it."""
    def text(n: Node) -> str:
        if isinstance(n, Simple):
            return n.cmd.source
        if isinstance(n, Not):
            return "! " + text(n.node)
        if isinstance(n, AndOr):
            return " ".join([text(n.first)] + [f"{op} {text(x)}" for op, x in n.rest])
        return type(n).__name__.lower()
    return "; ".join(text(n) for n in nodes)
