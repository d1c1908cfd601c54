"""Finding the reward function a config names, checking how it can be called, reading what it returns.

``reward.function`` is a built-in name or ``path/to/file.py:function`` / ``package.module:function``.
A per-sample function is called ``fn(response, answer, **reward.kwargs)``; a batched one
``fn(responses, answers, **reward.kwargs)`` and returns one result per response. A function that
declares a parameter ``extra`` (batched: ``extras``) also gets the dataset row's other columns.
A result is a number, or a dict with ``score`` and numeric components.

No torch here: reward worker processes import this module, and torch would cost each of them
~1.5 s and ~120 MB (measured).
"""

from __future__ import annotations

import difflib
from collections import ChainMap
import inspect
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fitrl.core.errors import ConfigError, UserError
from fitrl.core.user_code import resolve_named
from fitrl.rewards.by_source import ROUTED_REWARDS, by_source_reward
from fitrl.rewards.python import PYTHON_REWARDS

BUILTIN_REWARDS: dict[str, Callable[..., Any]] = dict(sorted({**ROUTED_REWARDS, "by_source": by_source_reward}.items()))
"""Every built-in reward, by name (alphabetical: the order error messages list them in)."""


class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something unusable: the user's function to fix, so
    the CLI prints it as one line (exit 2)."""

    kind = "reward error"


def canonical_spec(spec: str) -> str:
    """The spec with a file path made absolute, so worker processes find the same file."""
    if ":" in spec and spec.rsplit(":", 1)[0].endswith(".py"):
        where, name = spec.rsplit(":", 1)
        return f"{Path(where).resolve()}:{name}"
    return spec


def check_reward_spec(spec: str) -> None:
    """The cheap checks of ``reward.function`` (no user code runs): a built-in name, or a
    ``file.py:function`` whose file exists, or ``package.module:function``."""
    if spec in BUILTIN_REWARDS or spec in PYTHON_REWARDS:
        return
    if spec.startswith("python:"):
        raise ConfigError(f"reward.function={spec!r} names Python callables given to fitrl.train() in another "
                          "process; give them again (fitrl.train(reward_funcs=[...])) or name a file: "
                          "'path/to/file.py:function'")
    if ":" not in spec:
        near = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown reward function reward.function={spec!r}{hint} (valid: {', '.join(sorted(BUILTIN_REWARDS))}, "
                          "or 'path/to/file.py:function' / 'package.module:function')")
    where, name = spec.rsplit(":", 1)
    if not where or not name:
        raise ConfigError(f"reward.function={spec!r} must look like 'path/to/file.py:function' or "
                          "'package.module:function'")
    if where.endswith(".py") and not Path(where).is_file():
        raise ConfigError(f"reward.function: file not found: {where}")


def resolve_reward_fn(spec: str) -> Callable[..., Any]:
    """A built-in, a Python callable given to ``fitrl.train()``, or the function ``spec`` names."""
    return resolve_named(spec, ChainMap(BUILTIN_REWARDS, PYTHON_REWARDS), "reward.function", lambda spec: (
        f"reward.function={spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) "
        "nor 'path/to/file.py:function' / 'package.module:function'"))


@dataclass
class RewardFunction:
    """A resolved reward function and how to call it; checked against ``kwargs`` at start-up."""

    spec: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    batched: bool
    takes_extra: bool

    @classmethod
    def load(cls, spec: str, kwargs: dict[str, Any], *, batched: bool = False) -> "RewardFunction":
        fn = resolve_reward_fn(spec)
        if batched and spec in BUILTIN_REWARDS:
            raise ConfigError(f"reward.batched=true but the built-in reward {spec!r} scores one response per call; "
                              "set reward.batched=false")
        extra_name = "extras" if batched else "extra"
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):                    # some C functions have none: nothing to check
            signature = None
        takes_extra = signature is not None and extra_name in signature.parameters and extra_name not in kwargs
        if signature is not None:
            try:
                signature.bind(*(([], []) if batched else ("", None)), **kwargs,
                               **({extra_name: None} if takes_extra else {}))
            except TypeError as e:
                shape = "fn(responses, answers" if batched else "fn(response, answer"
                raise ConfigError(f"reward.function {spec} cannot be called as {shape}, **reward.kwargs={kwargs})"
                                  f"{' (reward.batched=true)' if batched else ''}: {e}") from e
        return cls(canonical_spec(spec), fn, dict(kwargs), batched, takes_extra)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.fn(*args, **self.kwargs, **kw)


def read_result(out: Any, name: str) -> tuple[float, dict[str, float]]:
    """One result -> (score, components). A wrong type raises RewardError naming the function;
    a NaN or infinite score raises ValueError (a per-sample failure, scored the fallback).

    >>> read_result(0.5, "f"), read_result({"score": 1, "exact": 1.0}, "f")
    ((0.5, {}), (1.0, {'exact': 1.0}))
    >>> read_result("high", "my_reward")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fitrl.rewards.functions.RewardError: reward function my_reward returned str ('high'); expected a number or ...
    """
    if isinstance(out, dict):
        if "score" not in out:
            raise RewardError(f"reward function {name} returned a dict without 'score' (keys: {sorted(out)})")
        parts = {}
        for k, v in out.items():
            if not _is_number(v):
                raise RewardError(f"reward function {name} returned {k}={v!r} ({type(v).__name__}); "
                                  "every value of the dict must be a number")
            parts[k] = float(v)
        score = parts.pop("score")
    elif _is_number(out):
        score, parts = float(out), {}
    else:
        raise RewardError(f"reward function {name} returned {type(out).__name__} ({str(out)[:80]!r}); "
                          "expected a number or a dict with a 'score' key")
    if not math.isfinite(score):
        raise ValueError(f"score is {score}")
    return score, parts


def read_batch(out: Any, n: int, name: str) -> list[Any]:
    """A batched function's return value -> its n per-response results, or RewardError naming it."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):   # numpy array, tensor
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"batched reward function {name} returned {type(out).__name__}; "
                          f"expected a list of {n} numbers or dicts")
    if len(out) != n:
        raise RewardError(f"batched reward function {name} returned {len(out)} results for {n} responses")
    return list(out)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"


FITRL_DIR = str(Path(__file__).resolve().parent.parent)


def user_traceback(error: BaseException) -> str:
    """The traceback of ``error`` in the user's own frames: fitrl's worker and call frames
    (everything under the fitrl package) left out, innermost last."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(FITRL_DIR)]
    return "".join(traceback.format_list(frames))
