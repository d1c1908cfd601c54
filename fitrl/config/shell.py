"""A launch script read as bash reads it, without running anything.

What veRL's and EasyR1's launch scripts use: assignments (``A=1``, ``export A=1``, arrays
``A=(x y)``) read top to bottom, with their expansions (:mod:`fitrl.config.shell_expand`);
``if``/``elif``/``else``, ``for``, ``while``, ``case``, functions, groups and ``&&``/``||``
(:mod:`fitrl.config.shell_flow`), taken as bash would take them where a test decides without
running a program (``[ "$backend" = megatron ]``, :mod:`fitrl.config.shell_eval`); redirections
and pipes; env-prefixed and wrapped commands (``VAR=1 python3 -m ...``, ``torchrun ... -m``,
``ray job submit ... -- python3 -m ...``); ``source`` of a file beside the script.

Where only running would decide (a file test, a command's status, a loop over ``$(ls)``), every
path is read and what they set differently carries the condition as unknown, so the importer
can say which key it feeds; a training command on such a path is read with a note.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

from fitrl.config.shell_eval import glob_regex, test_expr
from fitrl.config.shell_expand import Arr, Expander, Value, unique
from fitrl.config.shell_flow import AndOr, Case, For, Func, If, Loop, Node, Not, Parser, Simple, source_text
from fitrl.config.shell_launch import NOT_TRAINING, SOURCE, TRAINING, Arg, Launch, is_training, parse_launch
from fitrl.config.shell_lex import Cmd, Lexer, Lit, Word
from fitrl.config.text_file import read_text
from fitrl.core.errors import ConfigError

__all__ = ["Arg", "Launch", "Value", "explain", "is_training", "read_launch", "SOURCE", "TRAINING"]


LOOP_LIMIT = 64  # iterations read of one loop (launch scripts loop over a few values, or nodes)
STEP_LIMIT = 200_000  # commands read in all: nested loops of 64 stay well under a few seconds


def explain(unknown: str) -> str:
    """Why a value cannot be known without running, in words (one line: it ends an error line)."""
    return " ".join(_explain(unknown).split())


def _explain(unknown: str) -> str:
    if unknown.startswith("?"):
        return f"it depends on {unknown[1:]}, which only running the script would decide"
    if unknown.startswith("$(("):
        return f"`{unknown}` is arithmetic fitrl cannot evaluate"
    if unknown.startswith("`"):
        return f"{unknown} is a command, which fitrl does not run"
    if unknown.startswith("$("):
        return f"`{unknown}` is a command, which fitrl does not run"
    if unknown == "~":
        return "`~` is a home folder, which fitrl does not read"
    if re.fullmatch(r"\$\d+", unknown):
        return f"`{unknown}` is an argument to the script, which fitrl does not have"
    if unknown.startswith("${"):
        return f"`{unknown}` is a form of ${{...}} fitrl does not read"
    return f"{unknown[1:]} is not set in the script (fitrl does not read your environment)"


def read_launch(path: Path) -> Launch:
    """The last training command of the script at ``path``, its arguments expanded top to bottom."""
    try:
        return _Reader(path).read()
    except RecursionError:  # (thousands of nested blocks or substitutions: no launch script is)
        raise ConfigError(f"{path}: nested too deep to read (fitrl reads up to a few hundred levels)") from None


class _Stop(Exception):
    """``exit``, ``return``, ``break``, ``continue``: where reading a path of the script stops."""
    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class _Reader(Expander):
    def __init__(self, path: Path):
        super().__init__(path, str(path))
        self.funcs: dict[str, Node] = {}
        self.paths: list[str] = []  # what decides the path being read, where fitrl cannot tell
        self.loops: list[tuple[str, str, str]] = []
        self.launches: list[Launch] = []
        self.refused: list[Launch] = []
        self.depth = 0
        self.frames: list[dict] = []  # per function being called: its locals' values before the call
        self.steps = 0
        self.notes: list[str] = []  # what the reader could not follow (a sourced file not found)

    def parse(self, path: Path) -> list[Node]:
        return Parser(Lexer(read_text(path, SOURCE), str(path)).commands(), str(path)).parse()

    def read(self) -> Launch:
        try:
            self.run(self.parse(self.path))
        except _Stop:
            pass  # (exit, or a return at the top)
        if not self.launches:
            if self.refused:
                last = self.refused[-1]
                what = NOT_TRAINING[last.entry.rsplit(".", 1)[-1]]
                raise ConfigError(f"{self.path}:{last.line}: {last.entry} {what}: fitrl import-config reads "
                                  f"training commands ({TRAINING})")
            raise ConfigError(f"{self.path}: no `python3 -m verl.trainer.main_ppo` (or `verl.trainer.main`, "
                              f"`recipe.*.main_*`) command found")
        launch = self.launches[-1]
        lines = sorted({la.line for la in self.launches})
        if len(lines) > 1:
            launch.notes.append(f"the script has {len(lines)} training commands (lines "
                                f"{', '.join(map(str, lines))}): read the last one it reaches (line {launch.line})")
        for var, value, values in launch.loops:
            launch.notes.append(f"the training command runs once per value of {var} ({values}): read the last run, "
                                f"{var}={value}; give the keys it feeds after the script for another")
        if launch.paths:
            launch.notes.append(f"the training command (line {launch.line}) runs only as {launch.paths[0]} decides, "
                                f"which only running the script would: read as if it runs")
        launch.notes += [n for n in dict.fromkeys(self.notes) if n not in launch.notes]
        if self.defaulted:
            names = ", ".join(dict.fromkeys(self.defaulted))
            launch.notes.append(f"{names}: not set in the script, so the script's defaults for them are used (fitrl "
                                f"does not read your environment); override the keys they feed after the script")
        return launch

    # -- control flow

    def run(self, nodes: list[Node]) -> Optional[bool]:
        status: Optional[bool] = True
        for node in nodes:
            status = self.exec(node)
        return status

    def exec(self, node: Node) -> Optional[bool]:
        self.steps += 1
        if self.steps > STEP_LIMIT:
            raise ConfigError(f"{self.path}: more than {STEP_LIMIT} commands to read (loops inside loops?): fitrl "
                              f"reads a launch script's commands without running them, and stops here")
        if isinstance(node, Simple):
            return self.simple(node.cmd)
        if isinstance(node, AndOr):
            status = self.exec(node.first)
            for op, nxt in node.rest:
                if (op == "&&" and status is False) or (op == "||" and status is True):
                    continue
                if status is None:
                    at = f" (line {node.first.cmd.line})" if isinstance(node.first, Simple) else ""
                    self.branches([[nxt], []], f"`{source_text([node.first])}`{at}")
                    status = None
                else:
                    status = self.exec(nxt)
            return status
        if isinstance(node, Not):
            status = self.exec(node.node)
            return None if status is None else not status
        if isinstance(node, If):
            return self.if_(node)
        if isinstance(node, For):
            return self.for_(node)
        if isinstance(node, Loop):
            return self.loop(node)
        if isinstance(node, Case):
            return self.case(node)
        if isinstance(node, Func):
            self.funcs[node.name] = node.body
            return True
        if node.subshell:  # ( ... ): its variables do not reach the script
            saved = dict(self.vars)
            try:
                return self.run(node.body)
            finally:
                self.vars = saved
        return self.run(node.body)

    def if_(self, node: If) -> Optional[bool]:
        paths: list[list[Node]] = []
        why = None
        for cond, body, text in node.arms:
            status = self.run(cond)
            if status is False:
                continue
            paths.append(body)
            if status is True:
                break
            why = why or f"`if {text}` (line {node.line})"
        else:
            paths.append(node.orelse or [])
        if why is None:
            return self.run(paths[0])
        self.branches(paths, why)
        return None

    def for_(self, node: For) -> Optional[bool]:
        if node.words is None:
            values = self.args
        else:
            values = [f for w in node.words for f in self.fields(w)]
        why = f"`{node.source}` (line {node.line})"
        if values is None or any(v.unknown for v in values):
            unknown = Value(f"${{{node.var}}}", (f"?{why}",))
            self.branches([node.body, []], why, setup=lambda: self.vars.__setitem__(node.var, unknown))
            return None
        every = " ".join(v.text for v in values[:LOOP_LIMIT])
        for v in values[:LOOP_LIMIT]:
            self.vars[node.var] = v
            self.loops.append((node.var, v.text, every))
            try:
                self.run(node.body)
            except _Stop as stop:
                if stop.kind == "break":
                    break
                if stop.kind != "continue":
                    raise
            finally:
                self.loops.pop()
        return True

    def loop(self, node: Loop) -> Optional[bool]:
        """``while``, ``until`` and ``for ((...))``: iterated while the test is known."""
        why = f"`{node.source}` (line {node.line})"
        if node.arith is not None:
            init, test, step = node.arith
            self.arith(init)
            check = (lambda: self.arith_status(test)) if test.strip() else (lambda: True)
            after = (lambda: self.arith(step))
        else:
            def check():
                status = self.run(node.cond)
                return status if node.kind == "while" or status is None else not status
            after = None
        for _ in range(LOOP_LIMIT):
            status = check()
            if status is False:
                return True
            if status is None:
                self.branches([node.body, []], why)
                return None
            try:
                self.run(node.body)
            except _Stop as stop:
                if stop.kind == "break":
                    return True
                if stop.kind != "continue":
                    raise
            if after is not None:
                after()
        return True

    def case(self, node: Case) -> Optional[bool]:
        self.test_mode = True
        try:
            word = self.joined(node.word)
            paths, why = [], None
            for patterns, body in node.arms:
                values = [self.pattern(p) for p in patterns]
                if word.unknown or any(v.unknown for v in values):
                    paths.append(body)
                    why = why or f"`{node.source}` (line {node.line})"
                    continue
                if any(re.fullmatch(v.text, word.text, re.S) for v in values):
                    paths.append(body)
                    break
            else:
                paths.append([])
        finally:
            self.test_mode = False
        if why is None:
            return self.run(paths[0])
        self.branches(paths, why)
        return None

    def pattern(self, word: Word) -> Value:
        """A case pattern as a regular expression (its quoted parts literal)."""
        values = [(self.part(p), isinstance(p, Lit) and p.quoted or getattr(p, "quoted", False)) for p in word.parts]
        text = "".join(re.escape(v.text) if quoted else glob_regex(v.text) for v, quoted in values)
        return Value(text, unique(u for v, _ in values for u in v.unknown))

    def branches(self, paths: list[list[Node]], why: str, setup: Optional[Callable[[], None]] = None) -> None:
        """Read each path from the same state; what they leave differently depends on ``why``."""
        base_vars, base_funcs = dict(self.vars), dict(self.funcs)
        ends: list[tuple[dict, dict]] = []
        stops: list[_Stop] = []
        for path in paths:
            self.vars, self.funcs = dict(base_vars), dict(base_funcs)
            self.paths.append(why)
            try:
                if setup is not None:
                    setup()
                self.run(path)
                ends.append((self.vars, self.funcs))
            except _Stop as stop:
                stops.append(stop)
            finally:
                self.paths.pop()
        if not ends:
            raise stops[0]
        self.vars, self.funcs = {}, {}
        for name in dict.fromkeys(k for end, _ in ends for k in end):
            values = [end.get(name) for end, _ in ends]
            if all(v == values[0] for v in values):
                self.vars[name] = values[0]
                continue
            first = next(v for v in values if v is not None)
            self.vars[name] = _depends(first, why)
        for funcs in (f for _, f in ends):
            for name, body in funcs.items():
                self.funcs.setdefault(name, body)

    def arith_status(self, expr: str) -> Optional[bool]:
        v = self.arith(expr)
        return None if v.unknown else int(v.text) != 0

    # -- simple commands

    def simple(self, cmd: Cmd) -> Optional[bool]:
        if cmd.arith:
            return self.arith_status(cmd.words[0].parts[0].text)
        words = cmd.words
        prefix = 0
        while prefix < len(words) and self.assignment(words[prefix]):
            prefix += 1
        if prefix == len(words):  # A=1 B=2: the script's variables
            for w in words:
                self.assign(w)
            return True
        self.passes_args = False
        name = words[prefix].literal()
        if name in ("[", "test", "[["):
            return self.test(words[prefix:], name == "[[")
        fields = [f for w in words[prefix:] for f in self.fields(w)]
        name = fields[0].text.rsplit("/", 1)[-1] if fields else ""
        return self.builtin(name, words[prefix + 1:], fields, cmd.line)

    def builtin(self, name: str, words: list[Word], fields: list[Value], line: int) -> Optional[bool]:
        if name in ("export", "declare", "local", "readonly", "typeset"):
            for w in words:
                if self.frames and name in ("local", "declare", "typeset"):  # (in a function: its own until it returns)
                    var = (w.literal() or (w.parts[0].text if self.assignment(w) else "")).split("=")[0].rstrip("+")
                    if re.fullmatch(r"[A-Za-z_]\w*", var):
                        self.frames[-1].setdefault(var, self.vars.get(var))
                if self.assignment(w):
                    self.assign(w)  # (`local x=$x`: the caller's x, read before x is the function's)
                elif self.frames and name != "export" and w.literal() and w.literal() in self.frames[-1]:
                    self.vars[w.literal()] = Value("")  # (`local x`: empty, never the environment's)
            return True
        if name == "unset":
            for f in fields[1:]:
                self.vars.pop(f.text, None)
            return True
        if name in ("true", ":"):
            return True
        if name == "false":
            return False
        if name in ("exit", "return", "break", "continue"):
            raise _Stop(name)
        if name == "shift" and self.args is not None:
            self.args = self.args[int(fields[1].text) if len(fields) > 1 and fields[1].text.isdigit() else 1:]
            return True
        if name == "set" and "--" in [f.text for f in fields]:
            at = [f.text for f in fields].index("--")
            self.args = fields[at + 1:]
            return True
        if name == "read":
            for f in fields[1:]:
                if re.fullmatch(r"[A-Za-z_]\w*", f.text):
                    self.vars[f.text] = Value(f"${{{f.text}}}", (f"?`read {f.text}` (line {line})",))
            return None
        if name in ("source", ".") and len(fields) > 1:
            return self.source(fields[1], line)
        if name in self.funcs and fields[0].text == name:
            # (`main "$@"`: the function's arguments are the script's own, which fitrl does not have)
            return self.call(name, None if self.passes_args else fields[1:], line)
        launch = parse_launch(fields, line, self.passes_args)
        if launch is not None and is_training(launch.entry):
            launch.paths, launch.loops = tuple(self.paths), tuple(self.loops)
            self.launches.append(launch)
        elif launch is not None and launch.entry.rsplit(".", 1)[-1] in NOT_TRAINING:
            self.refused.append(launch)
        # a program's status is what only running tells (`if command -v nvidia-smi`); echo's is known
        return True if name in ("echo", "printf", "set", "shopt", "trap", "wait", "ulimit", "umask") else None

    def test(self, words: list[Word], double: bool) -> Optional[bool]:
        """``[ ... ]`` and ``[[ ... ]]``: a variable the script does not set reads as unset."""
        self.test_mode = True
        try:
            args = [f for w in words[1:] for f in (self.fields(w) if not double else [self.joined(w)])]
        finally:
            self.test_mode = False
        if args and args[-1].text in ("]", "]]"):
            args = args[:-1]
        return test_expr([None if a.unknown else a.text for a in args], double,
                         is_set=lambda n: n in self.vars or None)

    def call(self, name: str, args: Optional[list[Value]], line: int) -> Optional[bool]:
        if self.depth > 16:
            raise ConfigError(f"{self.path}:{line}: {name} calls itself too deep to read (bash would recurse)")
        saved, self.args = self.args, args
        self.depth += 1
        self.frames.append({})
        try:
            return self.exec(self.funcs[name])
        except _Stop as stop:
            if stop.kind != "return":
                raise
            return True
        finally:
            self.args = saved
            self.depth -= 1
            for var, old in self.frames.pop().items():  # the function's locals go, the caller's come back
                self.vars.pop(var, None)
                if old is not None:
                    self.vars[var] = old

    def source(self, file: Value, line: int) -> Optional[bool]:
        """``source x.sh``: read where it is found beside the script (or as given), else a note."""
        path = Path(file.text)
        found = None if file.unknown else next((p for p in ([path] if path.is_absolute() else
                                                            [self.path.parent / path]) if p.is_file()), None)
        if found is None or self.depth > 8:
            why = (explain(file.unknown[0]) if file.unknown else "sourced too deep" if found is not None
                   else "not found beside the script")
            self.notes.append(f"`source {file.text}` (line {line}): {why}: the variables it sets are not known "
                              f"here")
            return None
        self.depth += 1
        try:
            return self.run(self.parse(found))
        except _Stop as stop:
            if stop.kind != "return":
                raise
            return True
        finally:
            self.depth -= 1

def _depends(value, why: str):
    """``value`` as set on one of the paths ``why`` chooses between."""
    mark = f"?{why}"
    if isinstance(value, Arr):
        return Arr(tuple(Value(v.text, unique(v.unknown + (mark,))) for v in value.items))
    return Value(value.text, unique(value.unknown + (mark,)))
