"""Reward functions given as Python callables (``fitrl.train(reward_funcs=[...])``), as TRL's users
write them: ``fn(completions, **columns) -> list[float]`` (TRL's signature: the dataset's columns as
keyword arguments, the answer among them) or fitrl's ``fn(response, answer) -> float | dict``.

Several functions are summed with ``reward_weights`` (default 1 each), each logged as a component
under its own name. A callable lives in this process, so it is scored here (``reward.num_workers=0``):
the registry below maps the name a config carries to the function, for this process only.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

from fitrl.core.errors import ConfigError

PYTHON_REWARDS: dict[str, Callable[..., Any]] = {}
"""``python:<names>`` -> the batched function that scores with the given callables (this process only)."""


def register_python_rewards(fns: Sequence[Callable[..., Any]], weights: Optional[Sequence[float]] = None,
                            answer_key: str = "answer") -> str:
    """Register ``fns`` (weighted) as one batched reward and return the name ``reward.function`` takes."""
    fns = list(fns)
    if not fns or not all(callable(f) for f in fns):
        raise ConfigError("reward_funcs must be a non-empty list of callables")
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    if len(weights) != len(fns):
        raise ConfigError(f"reward_weights has {len(weights)} weights for {len(fns)} reward functions")
    names = _unique([getattr(f, "__name__", "reward") for f in fns])
    calls = [_caller(f, n, answer_key) for f, n in zip(fns, names)]

    def combined(responses: list[str], answers: list[Any], extras: Optional[list[dict]] = None) -> list[dict]:
        extras = extras if extras is not None else [{} for _ in responses]
        parts = [call(responses, answers, extras) for call in calls]
        return [{"score": sum(w * p[i] for w, p in zip(weights, parts)), **{n: p[i] for n, p in zip(names, parts)}}
                for i in range(len(responses))]

    name = "python:" + "+".join(names)
    PYTHON_REWARDS[name] = combined
    return name


def _caller(fn: Callable[..., Any], name: str, answer_key: str) -> Callable[[list, list, list], list[float]]:
    params = inspect.signature(fn).parameters
    if "completions" in params:  # TRL: one call per batch, the columns as keyword arguments
        def trl(responses: list[str], answers: list[Any], extras: list[dict]) -> list[float]:
            columns: dict[str, list] = {answer_key: list(answers)}
            for key in dict.fromkeys(k for e in extras for k in e):
                columns.setdefault(key, [e.get(key) for e in extras])
            accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            kwargs = {k: v for k, v in columns.items() if accepts_any or k in params}
            out = fn(completions=list(responses), **kwargs)
            if out is None or len(out) != len(responses):
                raise ValueError(f"reward function {name} returned {0 if out is None else len(out)} rewards for "
                                 f"{len(responses)} completions")
            return [0.0 if v is None else float(v) for v in out]
        return trl

    def per_sample(responses: list[str], answers: list[Any], extras: list[dict]) -> list[float]:
        out = []
        for r, a in zip(responses, answers):
            v = fn(r, a)
            out.append(float(v["score"]) if isinstance(v, dict) else float(v))
        return out
    return per_sample


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out
