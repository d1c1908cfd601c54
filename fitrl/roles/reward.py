"""The reward role: the configured function over a batch, bounded in time and loud when off.

``reward.function`` is resolved and its signature checked at start-up (a typo fails before any
model loads). Calls run in a pool of worker processes (:mod:`fitrl.rewards.pool`), each under
``reward.timeout`` seconds of wall clock. A call that times out or raises is scored
``reward.fallback_score``, counted (``reward/timeouts``, ``reward/errors``) and its input logged
once; when more than ``reward.max_error_fraction`` of a batch raises, the function is broken, not
unlucky, and the run stops with the first failing sample. A wrong return type or length stops
the run naming the function. Empty or degenerate responses that earn a positive reward are
measured every call (``reward/degenerate_positive``) and warned about once: format hacking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fitrl.config.schema import RewardConfig
from fitrl.rewards.answers import is_degenerate
from fitrl.rewards.functions import RewardError, RewardFunction, read_batch, read_result, user_traceback
from fitrl.rewards.pool import Outcome, RewardPool
from fitrl.telemetry.progress import PROGRESS

__all__ = ["REWARD_COMPONENTS", "RewardError", "RewardScorer", "Scored"]

REWARD_COMPONENTS = "reward_components"
"""The batch entry holding a scored rollout's components (``Batch.put_named``: (B, C) and their names)."""

logger = logging.getLogger("fitrl.rewards")
MAX_LOGGED_FAILURES = 20
"""Distinct failing inputs logged per kind (timeout, error) per scorer; later ones are only counted."""


@dataclass
class Scored:
    """What one scoring call returns: totals, components and the call's health, together."""

    scores: torch.Tensor
    """(B,) float32 total reward per response."""
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each component the function returned, (B,) each (0 where a call failed)."""
    health: dict[str, float] = field(default_factory=dict)
    """``reward/timeouts``, ``reward/errors``, ``reward/degenerate``, ``reward/degenerate_positive``,
    ``reward/worker_restarts`` of this call (counts, or fractions of the batch)."""


class RewardScorer:
    """Scores a batch with the function ``cfg.function``; ``close()`` stops its worker processes."""

    def __init__(self, cfg: RewardConfig):
        self.options = cfg
        self.name = cfg.function
        self.fn = RewardFunction.load(cfg.function, dict(cfg.kwargs), batched=self.options.batched)
        self.pool: Optional[RewardPool] = None
        if self.options.num_workers:
            self.pool = RewardPool(self.fn.spec, self.fn.kwargs, batched=self.options.batched,
                                   num_workers=self.options.num_workers, timeout=self.options.timeout)
        self._logged: dict[str, set] = {"timeout": set(), "error": set()}
        self._warned_degenerate = False
        self._shown_frames = False  # a failure's traceback (the user's frames) was logged

    def score(self, responses: list[str], answers: list[Any], sources: Optional[list[str]] = None, *,
              extras: Optional[list[dict]] = None) -> Scored:
        """Scores, components and health of one batch of responses."""
        n = len(responses)
        for what, col in (("answers", answers), ("sources", sources), ("extras", extras)):
            if col is not None and len(col) != n:
                raise ValueError(f"score(): {n} responses but {len(col)} {what}")
        if n == 0:
            return Scored(torch.zeros(0))
        extras = extras if extras is not None else [{} for _ in range(n)]
        if self.options.batched:
            calls = [((list(responses), list(answers)), {"extras": list(extras)} if self.fn.takes_extra else {})]
        else:
            calls = [((r, a), {"extra": e} if self.fn.takes_extra else {})
                     for r, a, e in zip(responses, answers, extras)]
        restarts_before = self.pool.restarts if self.pool else 0
        outcomes = (self.pool.run(calls, on_result=PROGRESS.beat) if self.pool
                    else [_beat(_call_here(self.fn, args, kw)) for args, kw in calls])
        if self.options.batched:
            outcomes = self._unbatch(outcomes[0], n)

        totals = [self.options.fallback_score] * n
        components: dict[str, list[float]] = {}
        failed = {"timeout": [], "error": []}
        for i, out in enumerate(outcomes):
            if out.status == "ok":
                try:
                    totals[i], parts = read_result(out.value, self.name)
                except ValueError as e:                     # NaN / inf: this sample, not the function
                    out = outcomes[i] = Outcome("error", detail=f"ValueError: {e}")
                else:
                    for k, v in parts.items():
                        components.setdefault(k, [0.0] * n)[i] = v
                    continue
            failed[out.status].append(i)
            if i == 0 or out is not outcomes[0]:           # a failed batched call is one failure: log it once
                self._log_failure(out, i, responses, answers, sources)
        errors = len(failed["error"])
        if errors > self.options.max_error_fraction * n:
            i = failed["error"][0]
            raise RewardError(f"reward function {self.name} raised {_first_line(outcomes[i].detail)} on "
                              f"{_sample(i, responses, answers, sources)}; {errors} of {n} responses raised, more "
                              f"than reward.max_error_fraction={self.options.max_error_fraction}")
        health = self._measure(totals, responses, failed, restarts_before)
        return Scored(torch.tensor(totals, dtype=torch.float32),
                      {k: torch.tensor(v, dtype=torch.float32) for k, v in components.items()}, health)

    def _unbatch(self, out: Outcome, n: int) -> list[Outcome]:
        if out.status != "ok":
            return [out] * n
        return [Outcome("ok", v) for v in read_batch(out.value, n, self.name)]

    def _log_failure(self, out: Outcome, i: int, responses: list[str], answers: list[Any],
                     sources: Optional[list[str]]) -> None:
        seen = self._logged[out.status]
        key = (responses[i], repr(answers[i]))
        if key in seen or len(seen) > MAX_LOGGED_FAILURES:
            return
        seen.add(key)
        what = "timed out" if out.status == "timeout" else "raised"
        if len(seen) > MAX_LOGGED_FAILURES:
            logger.warning("reward function %s %s on %d distinct inputs; further ones are counted in reward/%ss, "
                           "not logged", self.name, what, MAX_LOGGED_FAILURES, out.status)
            return
        on = _sample(i, responses, answers, sources)
        if self.options.batched:
            on = f"a batch of {len(responses)} responses (the first: {on})"
        detail = out.detail.rstrip()
        if self._shown_frames:  # the user's frames once; later failures their one line
            detail = detail.splitlines()[0] if detail else detail
        self._shown_frames = self._shown_frames or "\n" in detail
        logger.warning("reward function %s %s on %s; scored reward.fallback_score=%g: %s", self.name, what, on,
                       self.options.fallback_score, detail)

    def _measure(self, totals: list[float], responses: list[str], failed: dict[str, list[int]],
                 restarts_before: int) -> dict[str, float]:
        n = max(len(responses), 1)
        degenerate = [i for i, r in enumerate(responses) if is_degenerate(r)]
        paid = [i for i in degenerate if totals[i] > 0]
        health = {
            "reward/timeouts": float(len(failed["timeout"])),
            "reward/errors": float(len(failed["error"])),
            "reward/degenerate": len(degenerate) / n,
            "reward/degenerate_positive": len(paid) / n,
            "reward/worker_restarts": float(self.pool.restarts - restarts_before if self.pool else 0),
        }
        if paid and not self._warned_degenerate:
            self._warned_degenerate = True
            i = paid[0]
            logger.warning("reward function %s gave a positive score to %d of %d empty or degenerate responses "
                           "(no letter or digit outside markup), e.g. %r scored %g: it pays for format alone, "
                           "which the policy will learn (format hacking); see reward/degenerate_positive",
                           self.name, len(paid), len(degenerate), responses[i][:200], totals[i])
        return health

    def close(self) -> None:
        """Stops the worker processes (also done when the scorer is garbage-collected)."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _call_here(fn: RewardFunction, args: tuple, kw: dict[str, Any]) -> Outcome:
    """In-process call (``num_workers=0``): errors are caught like in a worker; time is not bounded."""
    try:
        return Outcome("ok", fn(*args, **kw))
    except Exception as e:  # noqa: BLE001 -- counted, logged, and fatal past max_error_fraction
        return Outcome("error", detail=f"{type(e).__name__}: {e}\n{user_traceback(e)}")


def _sample(i: int, responses: list[str], answers: list[Any], sources: Optional[list[str]]) -> str:
    where = f" (prompt {sources[i]})" if sources else ""
    return f"response {responses[i][:200]!r} with answer {answers[i]!r}{where}"


def _first_line(detail: str) -> str:
    return detail.split("\n", 1)[0]


def _beat(outcome: Outcome) -> Outcome:
    """A scored response is progress (the hang watchdog's heartbeat)."""
    PROGRESS.beat()
    return outcome
