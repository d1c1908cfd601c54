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
    from fitrl.rewards.functions import BUILTIN_REWARDS  # (that module registers this one)

    if name not in BUILTIN_REWARDS or name == "by_source":
        raise ValueError(f"by_source routes to {name!r}, which is not a built-in reward "
                         f"({', '.join(n for n in BUILTIN_REWARDS if n != 'by_source')})")
    return BUILTIN_REWARDS[name]


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` declares (a weight of one rule is not another's)."""
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}
