"""``fitrl import-config``: a veRL or EasyR1 job as a fitrl config, with a line per key.

The source is what those projects' users already have: a YAML config, a launch script (the
``python3 -m verl.trainer.main_ppo key=value ...``, ``verl.trainer.main config=... key=value`` or a
recipe's ``main_*`` command inside it, read as bash reads it by :mod:`fitrl.config.shell`), or bare
dotted overrides. Every source key is
reported as translated, approximated (with why) or not translated (with why); the result is a
fitrl YAML that ``fitrl config``, ``fitrl plan`` and ``fitrl train`` take as it is. The maps are in
:mod:`fitrl.config.import_maps` (docs/switching.md for people).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from fitrl.config.import_maps import (APPROXIMATED, EASYR1, HUB, NOT_TRANSLATED, REWARD_FILES, SPECIAL, TRANSLATED,
                                      VERL, VERL_PREFIXES, EASYR1_PREFIXES, Rule, expand_dict_values)
from fitrl.config.import_defaults import LAYOUTS, SOURCE_NAMES, layer, with_defaults
from fitrl.config.import_more import per_key_rules
from fitrl.config.import_moe_opd import MOE_AUX_KEYS, MOE_AUX_OFF
from fitrl.config.shell import SOURCE, Arg, Launch, explain, read_launch
from fitrl.config.text_file import read_text
from fitrl.core.errors import ConfigError
from fitrl.core.nested import flatten, nest

FORMATS = {"verl": VERL, "easyr1": EASYR1}
PREFIXES = {"verl": VERL_PREFIXES, "easyr1": EASYR1_PREFIXES}


@dataclass
class Imported:
    format: str
    config: dict[str, Any] = field(default_factory=dict)
    """Dotted fitrl keys and their values."""
    lines: list[tuple[str, str, str]] = field(default_factory=list)
    """(status, source key = value, what it became or why not), one per source key."""
    notes: list[str] = field(default_factory=list)
    """What the launch script holds that is not a key: a value left for the user, an ignored `$@`."""

    def count(self, status: str) -> int:
        return sum(1 for s, _, _ in self.lines if s == status)

    def report(self) -> list[str]:
        width = max((len(k) for _, k, _ in self.lines), default=0)
        return [f"{'note':<14} {n}" for n in self.notes] + \
            [f"{status:<14} {key:<{width}}  {text}" for status, key, text in self.lines]

    def yaml(self, source: str) -> str:
        """The fitrl config, headed by where it came from and the counts."""
        head = (f"# imported by `fitrl import-config` from {source} ({self.format}): {self.count(TRANSLATED)} keys "
                f"translated, {self.count(APPROXIMATED)} approximated, {self.count(NOT_TRANSLATED)} not translated\n")
        return head + yaml.safe_dump(nest(self.config), sort_keys=False)


def import_config(source: Optional[str], overrides: list[str] = (), fmt: str = "auto") -> Imported:
    """Translate ``source`` (a YAML file, a launch script, or None) plus ``overrides`` (dotted
    ``key=value``, as the source's own command line takes them)."""
    flat: dict[str, Any] = {}
    script_dir: Optional[Path] = None
    args: list[Arg] = []
    notes: list[str] = []
    if source is not None:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"{source}: no such file (give {SOURCE})")
        if path.suffix in (".yaml", ".yml"):
            flat.update(_own_keys(_read_yaml(path), f"{path} is a Hydra config", notes))
        else:
            base, args, notes = read_script(path)
            flat.update(base)
        script_dir = path.parent  # (relative files are the source's, from its repository: _relative)
    unknown: dict[str, Arg] = {}  # key -> the script's argument whose value only running would tell
    for arg in [*args, *(Arg(item, (), 0) for item in overrides)]:
        key, sep, value = arg.text.partition("=")
        if key.startswith("~"):  # Hydra's delete: the base config's value and the default both go
            key = key[1:]
            for k in [k for k in flat if k == key or k.startswith(key + ".")]:
                del flat[k]
            flat[key] = None  # (a null leaves the key unset, masking the source's default)
            unknown.pop(key, None)
            notes.append(f"~{key}: deleted: neither the base config's value nor the default is used")
            continue
        if not sep:
            raise ConfigError(f"override {arg.text!r}: expected key=value (or ~key to delete one)")
        key = key.lstrip("+")
        flat[key] = _value(value)
        unknown.pop(key, None)
        if arg.unknown:
            unknown[key] = arg
    if not flat:
        raise ConfigError("nothing to import: give a config or script, or key=value overrides")
    fmt = detect(flat) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise ConfigError(f"unknown source format {fmt!r} (verl, easyr1)")
    notes += _left_unknown(fmt, unknown, source)
    out = translate(fmt, flat, script_dir)
    out.notes[:0] = notes
    return out


NAME_OR_PATH = re.compile(r"(\w+_)?(path|dir|files?)|\w+_name|format_prompt|reward_function")


def _left_unknown(fmt: str, unknown: dict[str, Arg], source: Optional[str]) -> list[str]:
    """A name or path the script leaves to running (``$(date)``, an unset variable) stays as its
    text for the user to set; any other key fitrl uses cannot be guessed: one line, exit 2."""
    notes = []
    for key, arg in unknown.items():
        value, why = arg.text.partition("=")[2].replace("\n", "\\n"), explain(arg.unknown[0])  # (one line)
        if NAME_OR_PATH.fullmatch(key.rsplit(".", 1)[-1]):
            notes.append(f"{key}={value}: left for you to set: {why}")
            continue
        rule = FORMATS[fmt].get(key) or next((r for p, r in PREFIXES[fmt].items() if key.startswith(p)), None)
        if rule is not None and (rule.set is not None or rule.choose is not None):
            raise ConfigError(f"{source}:{arg.line}: {key}={value}: {why}; give {key}=VALUE after the script")
    return notes


def detect(flat: dict[str, Any]) -> str:
    roots = {k.split(".")[0] for k in flat}
    if "worker" in roots:
        return "easyr1"
    if roots & {"actor_rollout_ref", "custom_reward_function", "reward_model", "critic"} or "data.train_batch_size" in flat:
        return "verl"
    raise ConfigError(f"cannot tell the source's framework from its keys ({', '.join(sorted(roots))}): "
                      f"pass --format verl or --format easyr1")


def translate(fmt: str, flat: dict[str, Any], script_dir: Optional[Path] = None) -> Imported:
    out = Imported(fmt)
    rules = FORMATS[fmt]
    flat = expand_dict_values(flat)  # a dict-valued override merges into its section (import_rules)
    given = dict(flat)
    name = layer(fmt, flat)  # (an older release's layout has a layer of its own)
    flat = with_defaults(name, flat)  # keys left out keep the source's values, not fitrl's
    rules = {**rules, **per_key_rules(fmt, flat)}
    if name != fmt:
        out.notes.append(f"{SOURCE_NAMES[name]}'s layout (it sets {_layout_key(name, given)}): keys it leaves out "
                         f"keep {SOURCE_NAMES[name]}'s defaults")
    if fmt == "verl":
        out.config.update({"data.answer_key": "reward_model.ground_truth", "reward.function": "by_source"})
        out.lines.append((TRANSLATED, "(veRL's dataset layout)",
                          "data.answer_key=reward_model.ground_truth, reward.function=by_source (the rule reward "
                          "by each row's data_source)"))
    if not any(k in flat for k in MOE_AUX_KEYS):  # (a source key that says it is translated below instead)
        out.config["actor.router_aux_loss_coef"] = 0.0
        out.lines.append((TRANSLATED, f"({SOURCE_NAMES[fmt]}'s router loss)",
                          f"actor.router_aux_loss_coef=0: {MOE_AUX_OFF[fmt]}"))
    for key, value in flat.items():
        if key in SPECIAL or value is None:  # (a null in the source leaves the key unset)
            continue
        rule = rules.get(key) or next((r for p, r in PREFIXES[fmt].items() if key.startswith(p)), None)
        shown = f"{key}={_text(value)}" + (f" ({SOURCE_NAMES[name]}'s default)" if key not in given else "")
        if rule is None:
            if key in given:
                out.lines.append((NOT_TRANSLATED, shown, "no fitrl key for it"))
            continue
        _apply(out, rule, key, value, flat, shown)
    _special(out, fmt, flat, script_dir)
    return out


def _layout_key(name: str, given: dict) -> str:
    return next(k for k in LAYOUTS[name][1] if k in given)


def _apply(out: Imported, rule: Rule, key: str, value: Any, flat: dict, shown: str) -> None:
    try:
        if rule.choose is not None:
            rule = rule.choose(value)
        pairs = [] if rule.set is None else rule.set(value, flat)
    except (ValueError, TypeError) as e:  # a placeholder (TO_BE_FILLED) where the source takes a number
        raise ConfigError(f"{shown}: not a value this key takes ({e}); give {key}=VALUE after the script") from e
    if rule.set is None:
        out.lines.append((rule.status, shown, rule.why))
        return
    status, why = rule.status, rule.why
    hub = [v for k, v in pairs if k in ("actor.model.path", "critic.model.path", "teacher.model.path") and _is_hub_id(v)]
    hub += [f for k, v in pairs if k in ("data.train_files", "data.val_files") for f in v if _is_hub_dataset(f)]
    if hub:  # kept as the source names it: resolved through the Hugging Face cache when the run starts
        why = "; ".join(w for w in (why, f"{hub[0]} is a Hub id: {HUB}") if w)
    for k, v in pairs:
        out.config[k] = v
    text = ", ".join(f"{k}={_text(v)}" for k, v in pairs) or "(nothing to set)"
    out.lines.append((status, shown, text + (f": {why}" if why else "")))


def _special(out: Imported, fmt: str, flat: dict, script_dir: Optional[Path]) -> None:
    """What needs more than one key: EasyR1's reward file and prompt template."""
    if fmt != "easyr1":
        return
    spec = flat.get("worker.reward.reward_function")
    if spec:
        file = str(spec).split(":")[0]
        builtin = REWARD_FILES.get(Path(file).name)
        if builtin:
            out.config["reward.function"] = builtin
            out.lines.append((APPROXIMATED, f"worker.reward.reward_function={spec}",
                              f"reward.function={builtin}: fitrl's built-in scores the same answers (EasyR1's "
                              f"function takes a batch of dicts)"))
        else:
            out.lines.append((NOT_TRANSLATED, f"worker.reward.reward_function={spec}",
                              "EasyR1's functions take a batch of dicts: write fn(response, answer) and set "
                              "reward.function=path.py:fn"))
    template = flat.get("data.format_prompt")
    if template:
        found, how = _relative(str(template), script_dir)
        if how:
            out.notes.append(how)
        if found is None:
            out.lines.append((NOT_TRANSLATED, f"data.format_prompt={template}",
                              "file not found here: set data.prompt_template to its text"))
        else:
            prompt_key = out.config.get("data.prompt_key", "prompt")
            # EasyR1 renders the prompt as `content`
            text = re.sub(r"\bcontent\b", prompt_key, read_text(found, "a prompt template"))
            out.config["data.prompt_template"] = text
            out.lines.append((TRANSLATED, f"data.format_prompt={template}",
                              f"data.prompt_template=<{found.name}, its `content` read as the {prompt_key!r} column>"))


def read_script(path: Path) -> tuple[dict[str, Any], list[Arg], list[str]]:
    """The training command of a shell script: the flat base config (EasyR1's ``config=`` YAML,
    Hydra's ``--config-path``/``--config-name``), its other arguments, and the reader's notes."""
    launch = read_launch(path)
    notes = list(launch.notes)
    base = _hydra_base(launch, path, notes)
    args = []
    for arg in launch.args:
        key, _, value = arg.text.partition("=")
        if key != "config":
            args.append(arg)
            continue
        if arg.unknown:
            raise ConfigError(f"{path}:{arg.line}: config={value}: {explain(arg.unknown[0])}; give the YAML as "
                              f"the source instead")
        found, how = _relative(value, path.parent)
        if found is None:
            raise ConfigError(f"{path}: config={value} not found (looked beside the script and in its parent "
                              f"folders, then in the current directory)")
        if how:
            notes.append(how)
        base.update(flatten(_read_yaml(found)))
    return base, args, notes


def _hydra_base(launch: Launch, script: Path, notes: list[str]) -> dict[str, Any]:
    """``--config-path X --config-name Y``: Y.yaml, the base the overrides apply to. A relative X is
    Hydra's, beside the entry point's file, or beside the script (both from the script's folder up)."""
    name, folder = launch.config_name, launch.config_path
    if name is None:
        if folder is not None:
            notes.append(f"--config-path {folder.text} without --config-name: not read")
        return {}
    if name.unknown or folder is None:
        why = explain(name.unknown[0]) if name.unknown else f"{launch.entry}'s own config, not in this script's tree"
        notes.append(f"--config-name {name.text}: {why}: not read (keys the script leaves out keep the source "
                     f"framework's defaults)")
        return {}
    text = folder.text
    pwd = re.match(r"(\$\(pwd\)|`pwd`|\$\{PWD\}|\$PWD)/", text)
    if folder.unknown and pwd and set(folder.unknown) <= {"$(pwd)", "`pwd`", "$PWD"}:
        text = text[pwd.end():]
        notes.append(f"--config-path {folder.text}: `{pwd.group(1)}` read as the repository the script runs from "
                     f"(looked from the script's folder up)")
    elif folder.unknown:
        notes.append(f"--config-path {folder.text}: {explain(folder.unknown[0])}: --config-name {name.text} not read")
        return {}
    file = Path(text) / (name.text if name.text.endswith((".yaml", ".yml")) else name.text + ".yaml")
    module_dir = Path(*launch.entry.split(".")[:-1])
    tops = (script.parent, *script.parent.resolve().parents)
    candidates = [(file, "an absolute path")] if file.is_absolute() else (
        [(d / module_dir / file, f"Hydra's, relative to the entry point's folder {module_dir} in {d}") for d in tops]
        + [(d / file, f"relative to {d}, the folder the script runs from") for d in tops])
    found, how = next(((c, how) for c, how in candidates if c.is_file()), (None, ""))
    if found is None:
        notes.append(f"--config-path {folder.text} --config-name {name.text}: {file.name} not found beside the "
                     f"script or the entry point: not read ("
                     + OWN_CONFIGS.get(file.stem, "keys the script leaves out keep the source framework's defaults")
                     + ")")
        return {}
    notes.append(f"--config-name {name.text}: {found} is the base the script's arguments apply to ({how})")
    return _own_keys(_read_yaml(found), f"{found.name}", notes)


OWN_CONFIGS = {
    "ppo_trainer": "veRL's own ppo_trainer.yaml: keys the script leaves out keep veRL's defaults, as there",
    "ppo_megatron_trainer": "veRL's own ppo_megatron_trainer.yaml, for its Megatron backend: keys the script leaves "
                            "out keep veRL's FSDP defaults (fitrl trains with FSDP2)",
}
"""veRL's trainer configs a script names by --config-name: its defaults layer (fitrl/config/import_defaults.py)."""


def _own_keys(data: dict, what: str, notes: list[str]) -> dict[str, Any]:
    """A YAML config's own keys: its Hydra composition (``defaults:``, ``hydra:``) is not followed, and
    what it would bring is the defaults layer's (fitrl/config/import_defaults.py)."""
    skipped = [k for k in ("defaults", "hydra") if k in data]
    if skipped:
        notes.append(f"{what}: its Hydra `{'`, `'.join(skipped)}` not followed: keys it leaves out keep the source "
                     f"framework's defaults")
    return flatten({k: v for k, v in data.items() if k not in skipped})


def _relative(name: str, start: Optional[Path]) -> tuple[Optional[Path], str]:
    """``name`` (a source's ``config=``, ``format_prompt``) as the source finds it, and how: a
    relative path is read from the working directory the source's scripts assume, their
    repository's root (veRL's and EasyR1's examples run as ``bash examples/x.sh`` from it), which
    is the first folder from ``start`` (the script's or config's own) up that holds the path; the
    current directory only when none does (so a file of the same name there is never read instead)."""
    path = Path(name)
    if path.is_absolute():
        return (path if path.is_file() else None), ""
    for folder in ((start, *start.resolve().parents) if start is not None else ()):
        if (folder / path).is_file():
            return folder / path, (f"{name}: {folder / path}, read from {folder}, the folder the source runs from "
                                   f"(its repository's root: the first folder from the source's own up that holds "
                                   f"{name})")
    if path.is_file():
        return path, f"{name}: {path.resolve()}, from the current directory (no folder above the source holds it)"
    return None, ""


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(read_text(path, SOURCE))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return data


def _value(text: str) -> Any:
    """A command-line value as Hydra reads it: YAML scalars and lists (``'["console","wandb"]'``)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value):
        return float(value)  # 1e-6: a number to Hydra, a string to YAML 1.1
    return value


def _text(value: Any) -> str:
    if isinstance(value, str):
        s = value
    elif isinstance(value, bool) or value is None:
        s = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, (int, float)):
        s = f"{value:g}" if isinstance(value, float) else str(value)
    else:
        s = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    s = s.replace("\n", " ")
    return s if len(s) <= 60 else s[:57] + "..."


def _is_hub_id(value: Any) -> bool:
    return isinstance(value, str) and not Path(value).exists() and bool(re.fullmatch(r"[\w.-]+/[\w.-]+", value))


def _is_hub_dataset(value: Any) -> bool:
    """EasyR1's ``org/name@split``."""
    return isinstance(value, str) and bool(re.fullmatch(r"[\w.-]+/[\w.-]+@\w+", value))
