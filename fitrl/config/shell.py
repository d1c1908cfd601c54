"""A launch script read as bash reads it, without running anything.

The subset that veRL's and EasyR1's launch scripts use: assignments (``A=1``, ``export A=1``,
``A=$B/c``) read top to bottom; ``$A``, ``${A}``, ``${A:-default}`` (nested: ``${A:-"${B}/x"}``),
``${A:=x}``, ``${A:+x}``, ``${A:?}``; ``$((N * 8))``; ``\\`` + newline joins (inside a word too);
comments; single, double and multi-line quoting; word splitting of unquoted expansions; redirections
and pipes; env-prefixed and wrapped commands (``VAR=1 python3 -m ...``, ``torchrun ... -m``,
``ray job submit ... -- python3 -m ...``).

What only running would tell is never guessed: the environment of the import process is not read
(a variable the script does not set is ``${NAME}`` in the value), and ``$(command)``, backticks, ``~``
and script arguments stay as their text. Each such value carries what it holds (``Value.unknown``),
so the importer can say which key it feeds (:mod:`fitrl.config.importer`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fitrl.config.shell_lex import _Lexer, _Word, _arith_eval, _literal
from fitrl.config.text_file import read_text
from fitrl.core.errors import ConfigError


@dataclass(frozen=True)
class Value:
    text: str
    """The text bash would produce, with what is unknown left as its own text (``${N_GPUS}``)."""
    unknown: tuple[str, ...] = ()
    """What in ``text`` only running would tell: ``$N_GPUS``, ``$(date +%s)``, ``~``, ``$1``."""


@dataclass(frozen=True)
class Arg:
    text: str
    """One argument after the entry point, as bash hands it on: ``key=value``, ``+key=v``, ``~key``."""
    unknown: tuple[str, ...]
    line: int


@dataclass
class Launch:
    """The training command of a script."""
    entry: str
    """The module it runs (``verl.trainer.main_ppo``, ``recipe.dapo.main_dapo``)."""
    line: int
    args: list[Arg] = field(default_factory=list)
    config_path: Optional[Value] = None
    """Hydra's ``--config-path`` and ``--config-name``, as given."""
    config_name: Optional[Value] = None
    notes: list[str] = field(default_factory=list)
    """One line each for what was read differently from bash or not at all."""


# the commands a training command starts with besides python: `ray job submit ... -- python3 -m ...`
LAUNCHERS = {"torchrun", "ray", "env", "nohup", "uv", "srun", "deepspeed", "accelerate", "time", "exec",
             "numactl", "taskset", "stdbuf", "xvfb-run"}
RESERVED = {"then", "else", "do", "!", "{", "time", "exec"}
NOT_TRAINING = {"main_generation": "generates, it does not train", "main_eval": "evaluates, it does not train",
                "main_generation_server": "generates, it does not train",
                "fsdp_sft_trainer": "is supervised fine-tuning", "sft_trainer": "is supervised fine-tuning",
                "model_merger": "merges checkpoints, it does not train"}
SOURCE = "a veRL/EasyR1 YAML config or launch script"
"""What ``fitrl import-config`` reads, for the one line about a file that is not one."""
TRAINING = "verl.trainer.main_ppo, verl.trainer.main (EasyR1), a recipe's main_* (recipe.dapo.main_dapo)"


def is_training(module: str) -> bool:
    """veRL's and EasyR1's trainers and the recipes' entry points, which take the same keys."""
    last = module.rsplit(".", 1)[-1]
    return last not in NOT_TRAINING and (module in ("verl.trainer.main_ppo", "verl.trainer.main")
                                         or bool(re.fullmatch(r"main_\w+", last)))


def explain(unknown: str) -> str:
    """Why a value cannot be known without running, in words."""
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
    return _Reader(path).read()


class _Reader:
    def __init__(self, path: Path):
        self.path = path
        self.lexer = _Lexer(read_text(path, SOURCE), str(path))
        self.vars: dict[str, Value] = {}
        self.defaulted: list[str] = []  # variables the script does not set whose ${A:-default} was used
        self.passes_args = False  # "$@" in the command being read

    def read(self) -> Launch:
        launches, refused = [], []
        for line, words in self.lexer.commands():
            while words and len(words[0].parts) == 1 and words[0].parts[0][:2] in {("lit", r) for r in RESERVED}:
                words = words[1:]
            prefix = 0
            while prefix < len(words) and self.assignment(words[prefix]):
                prefix += 1
            if prefix == len(words):  # A=1 B=2: the script's variables
                for w in words:
                    self.assign(w)
                continue
            self.passes_args = False
            fields = [f for w in words[prefix:] for f in self.fields(w)]
            name = fields[0].text.rsplit("/", 1)[-1] if fields else ""
            if name in ("export", "declare", "local", "readonly", "typeset"):
                for w in words[prefix + 1:]:
                    if self.assignment(w):
                        self.assign(w)
                continue
            if name == "unset":
                for f in fields[1:]:
                    self.vars.pop(f.text, None)
                continue
            launch = self.launch(fields, line)
            if launch is not None and is_training(launch.entry):
                launches.append(launch)
            elif launch is not None and launch.entry.rsplit(".", 1)[-1] in NOT_TRAINING:
                refused.append(launch)
        if not launches:
            if refused:
                module = refused[-1].entry
                what = NOT_TRAINING[module.rsplit(".", 1)[-1]]
                raise ConfigError(f"{self.path}:{refused[-1].line}: {module} {what}: fitrl import-config reads "
                                  f"training commands ({TRAINING})")
            raise ConfigError(f"{self.path}: no `python3 -m verl.trainer.main_ppo` (or `verl.trainer.main`, "
                              f"`recipe.*.main_*`) command found")
        launch = launches[-1]
        if len(launches) > 1:
            launch.notes.append(f"the script runs {len(launches)} training commands: read the last "
                                f"(line {launch.line})")
        if self.defaulted:
            names = ", ".join(dict.fromkeys(self.defaulted))
            launch.notes.append(f"{names}: not set in the script, so the script's defaults for them are used (fitrl "
                                f"does not read your environment); override the keys they feed after the script")
        return launch

    def launch(self, fields: list[Value], line: int) -> Optional[Launch]:
        if not fields:
            return None
        first = fields[0].text.rsplit("/", 1)[-1]
        if not (re.fullmatch(r"python[\d.]*", first) or first in LAUNCHERS):
            return None
        for i, f in enumerate(fields):
            if f.text == "-m" and i + 1 < len(fields):
                module, rest = fields[i + 1].text, fields[i + 2:]
                break
            if f.text.endswith(".py"):
                module, rest = f.text[:-3].removeprefix("./").replace("/", "."), fields[i + 1:]
                break
        else:
            return None
        launch = Launch(module, line)
        if is_training(module):
            self.arguments(launch, rest)
        return launch

    def arguments(self, launch: Launch, rest: list[Value]) -> None:
        i = 0
        while i < len(rest):
            f = rest[i]
            option, eq, given = f.text.partition("=")
            if option in ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"):
                if not eq:
                    i += 1
                    given_value = rest[i] if i < len(rest) else Value("")
                else:
                    given_value = Value(given, f.unknown)
                if option in ("--config-path", "-cp"):
                    launch.config_path = given_value
                elif option in ("--config-name", "-cn"):
                    launch.config_name = given_value
                else:
                    launch.notes.append(f"{option} {given_value.text}: an extra Hydra search folder, not read")
            elif f.text.startswith("-"):
                launch.notes.append(f"{f.text}: an option of {launch.entry}, not read")
            elif "=" in f.text or f.text.startswith("~"):
                launch.args.append(Arg(f.text, f.unknown, launch.line))
            else:
                launch.notes.append(f"{f.text!r}: not a key=value argument (an unquoted value split by bash?), ignored")
            i += 1
        if self.passes_args:
            launch.notes.append("`$@`: the script passes on its own arguments, which are not known here: give them "
                                "after the script (fitrl import-config run.sh key=value ...)")

    # -- words

    @staticmethod
    def assignment(word: _Word) -> bool:
        p = word.parts[0] if word.parts else None
        return p is not None and p[0] == "lit" and not p[2] and bool(re.match(r"[A-Za-z_]\w*\+?=", p[1]))

    def assign(self, word: _Word) -> None:
        head = word.parts[0][1]
        name, _, rest = head.partition("=")
        value = self.joined(_Word([("lit", rest, True), *word.parts[1:]], word.line))
        if name.endswith("+"):  # A+=x
            name = name[:-1]
            old = self.vars.get(name, Value(""))
            value = Value(old.text + value.text, old.unknown + value.unknown)
        self.vars[name] = value

    def joined(self, word: _Word) -> Value:
        """A word without field splitting (an assignment's value, a ${A:-default}'s default)."""
        values = [self.part(p) for p in word.parts]
        return Value("".join(v.text for v in values), _unique(u for v in values for u in v.unknown))

    def fields(self, word: _Word) -> list[Value]:
        """The fields a word becomes: unquoted expansions split on white space, as bash does."""
        out, text, unknown, have = [], "", [], False

        def push():
            nonlocal text, unknown, have
            if have:
                out.append(Value(text, _unique(unknown)))
            text, unknown, have = "", [], False

        for p in word.parts:
            if p[0] == "var" and p[1] in "@*" and p[2] == "":
                self.passes_args = True  # (no arguments: "$@" is no word at all)
                continue
            v = self.part(p)
            quoted = p[0] == "lit" or p[-1] is True
            if quoted or v.unknown:  # (an unknown's text is a placeholder, one word)
                text, unknown, have = text + v.text, unknown + list(v.unknown), True
                continue
            pieces = v.text.split()
            if v.text[:1].isspace():
                push()
            for n, piece in enumerate(pieces):
                if n:
                    push()
                text, have = text + piece, True
            if v.text[-1:].isspace():
                push()
        push()
        return out

    def part(self, p: tuple) -> Value:
        kind = p[0]
        if kind == "lit":
            return Value(p[1])
        if kind == "tilde":
            return self.vars.get("HOME") or Value("~", ("~",))
        if kind == "cmd":
            return Value(p[1], (p[1],))
        if kind == "arith":
            return self.arith(p[1])
        return self.variable(p[1], p[2], p[3])

    def variable(self, name: str, op: str, arg: Optional[_Word]) -> Value:
        if op == "other":
            return Value(name, (name,))
        if name == "0":
            return Value(str(self.path))
        if name == "#":
            return Value("0")  # (run with no arguments)
        if name in "@*":
            return Value("")
        if name in "?$!-":
            return Value(f"${name}", (f"${name}",))
        v = self.vars.get(name)
        if op == "len":
            return Value(str(len(v.text))) if v is not None and not v.unknown else Value(f"${{#{name}}}", (f"${name}",))
        is_set = v is not None
        full = is_set and (v.text != "" or bool(v.unknown))
        if op in (":-", "-", ":=", "="):
            if full if op.startswith(":") else is_set:
                return v
            if not name.isdigit():
                self.defaulted.append(name)
            default = self.joined(arg)
            if op.endswith("=") and not name.isdigit():
                self.vars[name] = default
            return default
        if op in (":+", "+"):
            return self.joined(arg) if (full if op.startswith(":") else is_set) else Value("")
        if is_set:
            return v
        return Value(f"${{{name}}}", (f"${name}",))  # (":?" and plain: unknown)

    def arith(self, expr: str) -> Value:
        """``$(( ... ))``: bash's integer arithmetic over the script's variables."""
        raw = f"$(({expr}))"
        inner = self.joined(_Lexer(expr, self.lexer.name).word(stops="") or _Word([], 0))
        unknown: list[str] = list(inner.unknown)

        def names(text: str, depth: int) -> str:  # a variable's value is itself an expression
            def one(m: re.Match) -> str:
                v = self.vars.get(m.group(0))
                if v is None or v.unknown or depth > 8:
                    unknown.extend(v.unknown if v is not None and v.unknown else [f"${m.group(0)}"])
                    return "0"
                return f"({names(v.text, depth + 1)})"
            return re.sub(r"[A-Za-z_]\w*", one, text)

        text = names(inner.text, 0).replace("&&", " and ").replace("||", " or ")
        text = re.sub(r"!(?!=)", " not ", text)
        if not unknown:
            try:
                return Value(str(_arith_eval(ast.parse(text.strip() or "0", mode="eval"))))
            except (SyntaxError, ValueError, ZeroDivisionError, KeyError, TypeError):
                unknown.append(raw)
        return Value(raw, _unique(unknown))


def _unique(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
