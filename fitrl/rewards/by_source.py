"""One reward per data source: veRL's layout names each row's benchmark in ``data_source``
(``openai/gsm8k``, ``hiyouga/geometry3k``, ``lighteval/MATH``...) and scores each with that
benchmark's rule; ``reward.function=by_source`` does the same with fitrl's built-in rules.

Routes are ``(substring of the source, built-in reward)`` pairs, tried in order; a source that
matches none gets ``default``. The row's source column is ``source_key`` (``data_source``, as
``data.source_key``). ``reward.kwargs`` may replace ``routes`` and ``default``; other keyword
arguments go to every routed function that takes them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fitrl.rewards.arith import arith_reward
from fitrl.rewards.choice import choice_reward
from fitrl.rewards.rules import math_reward, r1v_reward, think_format_reward

ROUTED_REWARDS: dict[str, Callable[..., Any]] = {
    "arith": arith_reward,
    "choice": choice_reward,
    "math": math_reward,
    "r1v": r1v_reward,
    "think_format": think_format_reward,
}
"""The built-in rewards a source may route to: every built-in but this one
(fitrl/rewards/functions.py, ``BUILTIN_REWARDS``, adds it to these; kept here so that module
imports this one and not the other way round)."""

DEFAULT_ROUTES: tuple[tuple[str, str], ...] = (
    ("geometry3k", "r1v"), ("geo3k", "r1v"), ("clevr", "r1v"),  # <think>/<answer> with option letters
    ("arith", "arith"),
    ("gsm8k", "math"), ("math", "math"), ("numina", "math"), ("aime", "math"),  # final answer / \boxed{} / ####
)


def by_source_reward(response: str, answer: Any, *, extra: Optional[dict] = None, source_key: str = "data_source",
                     routes: Optional[list] = None, default: str = "math", **kwargs: Any) -> dict[str, float]:
    """The score of the built-in reward the row's source routes to (see the module docstring)."""
    source = str((extra or {}).get(source_key, ""))
    name = route(source, routes, default)
    fn = _builtin(name)
    out = fn(response, answer, **_accepted(fn, kwargs))
    return out if isinstance(out, dict) else {"score": float(out)}


def route(source: str, routes: Optional[list] = None, default: str = "math") -> str:
    """The built-in reward for ``source``: the first route whose substring it contains (case
    ignored), else ``default``."""
    low = source.lower()
    for part, name in (routes if routes is not None else DEFAULT_ROUTES):
        if str(part).lower() in low:
            return str(name)
    return default


def _builtin(name: str) -> Callable[..., Any]:
    if name not in ROUTED_REWARDS:
        raise ValueError(f"by_source routes to {name!r}, which is not a built-in reward "
                         f"({', '.join(ROUTED_REWARDS)})")
    return ROUTED_REWARDS[name]


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` declares (a weight of one rule is not another's)."""
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}
