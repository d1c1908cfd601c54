"""The training command of a launch script (:mod:`fitrl.config.shell`): which commands run a
veRL or EasyR1 trainer (or a recipe's, which takes the same keys), and their arguments as the
importer reads them (``key=value``, ``+key``, ``~key``, Hydra's ``--config-path``/``--config-name``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from fitrl.config.shell_expand import Value


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
    paths: tuple[str, ...] = ()
    """What decides whether it runs, where fitrl cannot tell (``if [ -f x ]`` (line 3))."""
    loops: tuple[tuple[str, str, str], ...] = ()
    """(variable, its value in this run, every value) of each loop it runs in."""


# the commands a training command starts with besides python: `ray job submit ... -- python3 -m ...`
LAUNCHERS = {"torchrun", "ray", "env", "nohup", "uv", "srun", "deepspeed", "accelerate", "time", "exec",
             "numactl", "taskset", "stdbuf", "xvfb-run", "command"}
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


def parse_launch(fields: list[Value], line: int, passes_args: bool) -> Optional[Launch]:
    """The command in ``fields`` when it runs python (directly or by a launcher), with its arguments."""
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
        _arguments(launch, rest, passes_args)
    return launch

def _arguments(launch: Launch, rest: list[Value], passes_args: bool) -> None:
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
            if not given_value.text:
                launch.notes.append(f"{option} without a value: not read (Hydra would refuse it)")
            elif option in ("--config-path", "-cp"):
                launch.config_path = given_value
            elif option in ("--config-name", "-cn"):
                launch.config_name = given_value
            else:
                launch.notes.append(f"{option} {given_value.text}: an extra Hydra search folder, not read")
        elif f.text.startswith("-"):
            launch.notes.append(f"{f.text}: an option of {launch.entry}, not read")
        elif re.match(r"(\+\+|\+|~)?[A-Za-z_][\w.@/-]*(=|$)", f.text) and ("=" in f.text or f.text.startswith("~")):
            launch.args.append(Arg(f.text, f.unknown, launch.line))
        else:
            launch.notes.append(f"{f.text!r}: not a key=value argument (an unquoted value split by bash?), ignored")
        i += 1
    if passes_args:
        launch.notes.append("`$@`: the script passes on its own arguments, which are not known here: give them "
                            "after the script (fitrl import-config run.sh key=value ...)")
