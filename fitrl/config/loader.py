"""Load, validate, save and describe a :class:`FitrlConfig`.

``load_config("run.yaml", ["actor.optim.lr=1e-5"])`` reads the YAML file (and any ``base:``
file it names, deep-merged underneath), applies dotted overrides on top, then builds the
dataclasses of :mod:`fitrl.config.schema` field by field. Every problem a user can make
becomes a one-line :class:`ConfigError` naming the dotted key and where it was set
(``(in overrides)`` or ``(in path/to/file.yaml)``): unknown keys come with the nearest valid
key, wrong types with the expected type and the value given.

Only PyYAML and the standard library are imported: the CLI uses this module to answer
configuration errors before anything heavy loads.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import textwrap
import typing
from typing import Any, Literal, Optional, Sequence, Union

import yaml

from .schema import ConfigError, FitrlConfig
from .text_file import read_text
from .trl_names import fitrl_keys

__all__ = ["load_config", "config_from_dict", "config_to_dict", "save_config", "describe_fields"]

OVERRIDES = "overrides"  # the source label of command-line overrides

MOVED: dict[str, str] = {
    "plan.images.max_pixels": "data.max_pixels",
    "plan.images.per_prompt": "data.limit_images (images per prompt; the plan counts this worst case)",
    "plan.images.pixels": "nothing (the plan counts the largest image within data.max_pixels)",
    # the vLLM engine is fitrl's own now: its settings are run keys the trainer and the planner read
    "plan.rollout.engine": "rollout.engine",
    "plan.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "plan.rollout.tensor_parallel_size": "rollout.tensor_parallel_size",
    "plan.rollout.sleep_level": "rollout.sleep_level",
    # another framework's engine behaviours, which fitrl's engine never has: planner-only
    "plan.rollout.free_cache_engine": "plan.emulate.free_cache_engine",
    "plan.rollout.separate_processes": "plan.emulate.separate_processes",
    "plan.rollout.swap_space_gib": "plan.emulate.swap_space_gib",
}
"""Keys that are gone -> what replaced them. A config that still sets one gets this, in one line,
instead of "unknown config key"."""


# ----------------------------------------------------------------------------- loading

def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> FitrlConfig:
    """Read ``path`` (None: schema defaults), apply ``key=value`` overrides, validate."""
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}  # dotted key -> the file (or "overrides") that set it last
    layers = _read_file_chain(path, ()) if path else []
    layers.append((OVERRIDES, _parse_overrides(overrides)))
    for label, data in layers:
        _merge(merged, data, label, origins)
    cfg = _checked(_build(FitrlConfig, merged, "", origins))
    # Which keys a file or an override set (dotted): a default that depends on the command (`fitrl
    # sft`'s learning rate, fitrl/trainer/sft.py) applies only where none did. Not a field: it is
    # not saved with the config (the saved config has every value set).
    cfg.given_keys = frozenset(origins)
    return cfg


def config_from_dict(data: dict[str, Any], source: str = "") -> FitrlConfig:
    """Validate a nested dict (as read from YAML) into a :class:`FitrlConfig`."""
    return _checked(_build(FitrlConfig, data, "", {"": source} if source else {}))


def _checked(cfg: FitrlConfig) -> FitrlConfig:
    """Registry-backed names (estimator, losses, KL estimators, reward) against their registries."""
    # Imported here, not at the top: the registries import torch (~2 s), which a config whose
    # keys or types are wrong should not wait for.
    from fitrl.config.choices import check_choices

    check_choices(cfg)
    return cfg


def _read_file_chain(path: str, seen: tuple[str, ...]) -> list[tuple[str, dict]]:
    """The layers of ``path`` base-first: its ``base:`` chain, then the file itself."""
    real = os.path.realpath(path)
    if real in seen:
        chain = " -> ".join([*seen[seen.index(real):], real])
        raise ConfigError(f"config files include each other through 'base:' in a cycle: {chain}")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    text = read_text(path, "a fitrl YAML config")  # (binary, UTF-16 or not UTF-8: one line)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_error_text(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (data:, actor:, ...), "
                          f"got {_given(data)}")
    base = data.pop("base", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"'base' in {path} must be a path to another YAML file, got {_given(base)}")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), os.path.expanduser(base)))
    if not os.path.exists(base_path):
        raise ConfigError(f"config file not found: {base_path} (the 'base' of {path})")
    return [*_read_file_chain(base_path, (*seen, real)), (path, data)]


def _yaml_error_text(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())


def _parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "a.c=[x,y]"]`` -> ``{"a": {"b": 1, "c": ["x", "y"]}}`` (later ones win)."""
    if isinstance(overrides, str):
        overrides = [overrides]
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {item!r} must look like key=value, e.g. trainer.max_steps=20")
        nested: Any = _parse_value(text, _type_at(parts))
        for part in reversed(parts):
            nested = {part: nested}
        _merge(result, nested, OVERRIDES, {})
    return result


def _parse_value(text: str, tp: Any) -> Any:
    """YAML-parse an override's value; text meant for a string field is kept verbatim
    (``trainer.experiment_name=2024``, ``data.system_prompt=Answer: briefly``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if _accepts_text(tp) and not isinstance(value, (str, list)) and value is not None:
        return text
    return value


def _merge(dst: dict, src: dict, label: str, origins: dict[str, str], prefix: str = "") -> None:
    """Deep-merge ``src`` into ``dst`` in place, noting in ``origins`` who set each key."""
    for key, value in src.items():
        path = f"{prefix}{key}"
        origins[path] = label
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, label, origins, path + ".")
            continue
        dst[key] = copy.deepcopy(value)
        for stale in [p for p in origins if p.startswith(path + ".")]:
            del origins[stale]
        if isinstance(value, dict):  # record the keys under it too
            _merge({}, value, label, origins, path + ".")


# -------------------------------------------------------------------------- validation

def _build(cls: type, data: Any, prefix: str, origins: dict[str, str]) -> Any:
    """Build dataclass ``cls`` from a mapping, converting each field to its annotated type."""
    hints = _hints(cls)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        key = prefix.rstrip(".")
        example = next((n for n, tp in hints.items() if _section_class(tp) is None), next(iter(hints)))
        raise ConfigError(f"config key '{key}'{_where(key, origins)} is a section and needs a mapping of "
                          f"its fields ({', '.join(hints)}), got {_given(data)}; set a field instead, "
                          f"e.g. {key}.{example}=...")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise ConfigError(_moved_key_message(key, value, origins)
                              or _unknown_key_message(key, value, list(hints), origins))
        kwargs[name] = _convert(value, hints[name], key, origins)
    return cls(**kwargs)  # a ConfigError from __post_init__ passes through unchanged


def _convert(value: Any, tp: Any, key: str, origins: dict[str, str]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", origins)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], key, origins)
        raise TypeError(f"fitrl schema: unsupported union {tp} at {key}")
    if tp is Any:
        return value
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads a bare off/on as a boolean
        if any(type(value) is type(a) and value == a for a in args):
            return value
        allowed = ", ".join(repr(a) for a in args)
        raise ConfigError(f"config key '{key}'{_where(key, origins)} expects one of {allowed}, got {_given(value)}")
    if origin is list:
        if isinstance(value, str) and args[0] is str:
            value = [value]
        if isinstance(value, (list, tuple)):
            return [_convert(v, args[0], f"{key}[{i}]", origins) for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str):
                    raise ConfigError(f"config key '{key}'{_where(key, origins)} needs string keys, "
                                      f"got {_given(k)}")
            return {k: _convert(v, args[1], f"{key}.{k}", origins) for k, v in value.items()}
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is not None:
            # nan compares false with every bound a section checks (lr <= 0 lets it through) and
            # inf passes the lower ones: no float key of the schema means either.
            if not math.isfinite(number):
                raise ConfigError(f"config key '{key}'{_where(key, origins)} must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"fitrl schema: unsupported annotation {tp} at {key}")
    raise ConfigError(f"config key '{key}'{_where(key, origins)} expects {_type_text(tp)}, got {_given(value)}")


def _moved_key_message(key: str, value: Any, origins: dict[str, str]) -> Optional[str]:
    """``config key 'plan.images.max_pixels' (in x.yaml) was replaced: plan.images.max_pixels ->
    data.max_pixels`` when ``key`` (or a key under it) is in :data:`MOVED`, else None. The keys
    named are those set under ``key``, or every moved key under it when none of them is."""
    under = [old for old in MOVED if old == key or old.startswith(key + ".")]
    if not under:
        return None
    given, stack = [], [(key, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict) and v:
            stack += [(f"{path}.{k}", sub) for k, sub in reversed(list(v.items()))]
        else:
            given.append(path)
    named = [old for old in under if old in given] or under
    shown = named[0] if len(named) == 1 and named == given else key
    return (f"config key '{shown}'{_where(key, origins)} was replaced: "
            + ", ".join(f"{old} -> {MOVED[old]}" for old in named))


def _unknown_key_message(key: str, value: Any, siblings: list[str], origins: dict[str, str]) -> str:
    """One line naming ``key`` and the nearest valid key, or the section's valid keys."""
    prefix, _, name = key.rpartition(".")
    tail = ""  # a misplaced chain like actr.optim.lr: name all of it, suggest all of it
    while isinstance(value, dict) and len(value) == 1:
        (sub, value), = value.items()
        tail += f".{sub}"
    head = f"unknown config key '{key}{tail}'{_where(key, origins)}"
    paths = _all_paths()
    # a TRL GRPOConfig name fitrl spells differently: fitrl's key, not the nearest spelling
    trl = "" if any(p.rpartition(".")[2] == name for p in paths) else fitrl_keys(name)
    if trl:
        return f"{head}; TRL's {name} is {trl} in fitrl"
    close = difflib.get_close_matches(name, siblings, n=1)
    if close:
        best = f"{prefix}.{close[0]}" if prefix else close[0]
    else:
        # the same (or a similar) name in another section: trainer.lr -> actor.optim.lr
        leaves = difflib.get_close_matches(name, sorted({p.rpartition(".")[2] for p in paths}), n=1, cutoff=0.75)
        candidates = [p for p in paths if leaves and p.rpartition(".")[2] == leaves[0]]
        # siblings were tried above; the key's own section is never a useful answer
        others = [p for p in paths if p.rpartition(".")[0] != prefix and not key.startswith(p + ".")]
        candidates = candidates or difflib.get_close_matches(key, others, n=1)
        if not candidates:
            section = f"'{prefix}'" if prefix else "the top level"
            return f"{head}; valid keys in {section}: {', '.join(siblings)}"
        best = max(candidates, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    if tail and best + tail in paths:
        best += tail
    return f"{head}; did you mean '{best}'?"


def _where(key: str, origins: dict[str, str]) -> str:
    """`` (in overrides)`` / `` (in x.yaml)`` for the nearest recorded ancestor of ``key``."""
    path = key.split("[", 1)[0]
    while True:
        if path in origins:
            return f" (in {origins[path]})"
        if not path:
            return ""
        path = path.rpartition(".")[0]


def _given(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


# ------------------------------------------------------------------------ type helpers

@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of the init fields of dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _section_class(tp: Any) -> Optional[type]:
    """The dataclass behind ``tp`` (a dataclass or Optional[dataclass]), else None."""
    if typing.get_origin(tp) is Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _type_at(parts: Sequence[str]) -> Any:
    """The schema annotation at a dotted key (None if the key is not a schema field)."""
    cls: Optional[type] = FitrlConfig
    tp = None
    for part in parts:
        if cls is None or part not in _hints(cls):
            return None
        tp = _hints(cls)[part]
        cls = _section_class(tp)
    return tp


def _accepts_text(tp: Any) -> bool:
    """str, Optional[str] and list[str] fields: override text for them is taken as written."""
    if typing.get_origin(tp) in (Union, list):
        return any(_accepts_text(a) for a in typing.get_args(tp))
    return tp is str


@functools.lru_cache(maxsize=None)
def _all_paths(cls: type = FitrlConfig, prefix: str = "") -> tuple[str, ...]:
    paths: list[str] = []
    for name, tp in _hints(cls).items():
        paths.append(prefix + name)
        sub = _section_class(tp)
        if sub is not None:
            paths += _all_paths(sub, f"{prefix}{name}.")
    return tuple(paths)


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        return " | ".join("None" if a is type(None) else _type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    if tp is Any:
        return "Any"
    return getattr(tp, "__name__", str(tp))


# ----------------------------------------------------------------- saving and describing

def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain dicts, lists and scalars (what ``yaml.safe_dump`` accepts)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: FitrlConfig, path: str) -> None:
    """Write ``cfg`` as YAML that :func:`load_config` reads back to an equal config."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)


def describe_fields(cls: type = FitrlConfig) -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default repr, docstring)`` for every leaf field of ``cls``.

    Sections are walked into; an optional section (``ref.model``, default None) gets a row of
    its own and then rows for its fields, with the defaults it has once set.
    """
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls: type, obj: Any, prefix: str) -> None:
        docs = _field_docs(cls)
        for name, tp in _hints(cls).items():
            key, value, sub = prefix + name, getattr(obj, name), _section_class(tp)
            if sub is None or value is None:
                rows.append((key, _type_text(tp), repr(value), docs.get(name, "")))
            if sub is not None:
                walk(sub, sub() if value is None else value, key + ".")
            args = typing.get_args(tp)  # a section by name (reward.sources): one entry's fields
            if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
                walk(args[1], args[1](), key + ".<name>.")

    walk(cls, cls(), "")
    return rows


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right under each annotated field, a base class's
    first (a subclass that redeclares a field documents it anew)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if "__dataclass_fields__" not in klass.__dict__:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs
