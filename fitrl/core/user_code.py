"""Importing what a config names as a built-in name, ``path/to/file.py:Name`` or
``package.module:Name`` (a reward function, an environment class, a tool), with one clear line for
each way it can fail."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable, Mapping

from fitrl.core.errors import ConfigError


def resolve_named(spec: str, builtins: Mapping[str, Any], key: str, unknown: Callable[[str], str],
                  noun: str = "function") -> Any:
    """The built-in ``spec`` names, else the object ``path/to/file.py:Name`` / ``package.module:Name``
    names (:func:`import_named`); :class:`ConfigError` with the message ``unknown(spec)`` for a spec
    that is neither (the caller's words: its key and what its built-ins are)."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ConfigError(unknown(spec))
    return import_named(spec, key, noun)


def import_named(spec: str, key: str, noun: str = "function") -> Any:
    """The object ``spec`` names; :class:`ConfigError` naming ``key`` when the file is missing,
    does not import (its own error and line), or has no ``Name``."""
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"{key}: file not found: {where}")
        module_spec = importlib.util.spec_from_file_location(f"fitrl_user_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as e:
            raise ConfigError(f"{key}: {e.filename or where}:{e.lineno}: syntax error: {e.msg}") from e
        except Exception as e:  # the user's module failed at import: its own error, one line
            raise ConfigError(f"{key}: importing {where} raised {raised_at(e, where)}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"{key}: cannot import module {where!r}: {e}") from e
        except SyntaxError as e:
            raise ConfigError(f"{key}: {e.filename}:{e.lineno}: syntax error: {e.msg}") from e
        except Exception as e:
            raise ConfigError(f"{key}: importing module {where!r} raised {raised_at(e, where)}") from e
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        raise ConfigError(f"{key}: {where} has no {noun} {name!r}")
    return obj


def raised_at(error: BaseException, fallback: str) -> str:
    """``NameError: ... (at file.py:3)``: the error and the innermost frame of the user's code."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename]
    where = f"{user[-1].filename}:{user[-1].lineno}" if user else fallback
    return f"{type(error).__name__}: {error} (at {where})"
