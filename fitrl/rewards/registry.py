"""Finding the reward function a config names, and calling it over a batch.

``reward.function`` is a registered name (``arith``), ``path/to/file.py:function`` or
``package.module:function``; it is resolved and its signature checked at start-up, so a typo
fails before any model is loaded. A function that raises is reported with the sample that
made it raise: a crash, never a silent 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

import torch

from fitrl.config.schema import ConfigError, RewardConfig
from fitrl.rewards.arith import arith_reward

BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {"arith": arith_reward}


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


def resolve_reward_fn(spec: str) -> Callable[..., Any]:
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(f"reward.function={spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) "
                          "nor 'path/to/file.py:function' / 'package.module:function'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"reward.function: file not found: {where}")
        module_spec = importlib.util.spec_from_file_location(f"fitrl_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"reward.function: cannot import module {where!r}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.function: {where} has no function {name!r}")
    return fn


class RewardScorer:
    """Calls a per-sample reward ``fn(response, answer, **kwargs) -> float | dict`` over a batch."""

    def __init__(self, cfg: RewardConfig):
        self.fn = resolve_reward_fn(cfg.function)
        self.name = cfg.function
        self.kwargs = dict(cfg.kwargs)
        try:
            inspect.signature(self.fn).bind("response", "answer", **self.kwargs)
        except TypeError as e:
            raise ConfigError(f"reward.function {self.name} cannot be called as fn(response, answer, "
                              f"**reward.kwargs={self.kwargs}): {e}") from e

    def score(self, responses: list[str], answers: list[Any], sources: list[str] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns scores (B,) and each component (B,)."""
        totals, components = [], {}
        for i, (resp, ans) in enumerate(zip(responses, answers)):
            try:
                out = self.fn(resp, ans, **self.kwargs)
            except Exception as e:
                where = f" (prompt {sources[i]})" if sources else ""
                raise RewardError(f"reward function {self.name} raised {type(e).__name__}: {e} on response "
                                  f"{resp[:200]!r} with answer {ans!r}{where}") from e
            total, parts = self._normalise(out)
            totals.append(total)
            for k, v in parts.items():
                components.setdefault(k, [0.0] * len(responses))[i] = v
        return (torch.tensor(totals, dtype=torch.float32),
                {k: torch.tensor(v, dtype=torch.float32) for k, v in components.items()})

    def _normalise(self, out: Any) -> tuple[float, dict[str, float]]:
        if isinstance(out, bool) or not isinstance(out, (int, float, dict)):
            raise RewardError(f"reward function {self.name} returned {type(out).__name__}; "
                              "expected a number or a dict with a 'score' key")
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(f"reward function {self.name} returned a dict without 'score': {sorted(out)}")
            return float(out["score"]), {k: float(v) for k, v in out.items() if k != "score"}
        return float(out), {}
