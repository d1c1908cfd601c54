r"""Validation metrics beyond the overall means: split by data source, and @n over the n samples
of each prompt (``rollout.val.n > 1``). Definitions in docs/metrics.md ("Validation").

A sample is *correct* when ``reward.correct_key``'s value (unset: the ``accuracy`` component,
else ``exact``, else the score) is >= ``reward.correct_threshold`` (1.0). For a prompt with n
samples:

- ``mean@n``: the fraction of its n samples that are correct;
- ``best@n`` (pass@n, k = n): 1 when any of them is correct;
- ``maj@n``: 1 when the most common final answer among them is correct. Answers are read as
  the reward reads them (:func:`fitrl.rewards.rules.final_answer`) and normalised (spaces,
  ``$``, ``\left``/``\right``, a trailing period), so answers equal only mathematically
  ("0.5", "1/2") vote apart; samples without an answer do not vote; a tie goes to the answer
  seen first; a prompt where nobody answered scores 0. The winner's correctness is its
  samples' (they carry the same answer, so the reward judged them alike);
- ``reward/best@n``: the highest score among the n.

Each is averaged over prompts. Per source, the same plus the reward, its components and the
response length, under ``val/by_source/<source>/``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable, Iterable, Optional, Sequence

from fitrl.config.schema import FitrlConfig
from fitrl.core.errors import RunStopped
from fitrl.data.batch import Batch
from fitrl.rewards import CORRECT_COMPONENTS
from fitrl.rewards.rules import final_answer
from fitrl.rollout.agent import agent_metrics

UNKNOWN_SOURCE = "unknown"

_SPACES = re.compile(r"\s+")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,;!]|\$")


def normalize_answer(answer: str) -> str:
    r"""The form answers are compared in when voting: no spaces, no ``$``, ``\left``/``\right``
    or thin spaces, no trailing period, ``\dfrac``/``\tfrac`` as ``\frac``.

    >>> normalize_answer(r" $\dfrac{1}{2}$. "), normalize_answer(r"\left( 1, 2 \right)")
    ('\\frac{1}{2}', '(1,2)')
    """
    text = _LATEX_NOISE.sub("", answer)
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    return _SPACES.sub("", text).rstrip(".")


def correctness_key(component_names: Iterable[str], key: Optional[str]) -> str:
    """The value that says a sample is correct: ``key`` (a component or ``score``), else the first
    of :data:`CORRECT_COMPONENTS` the reward returns, else ``score``."""
    names = list(component_names)
    if key is not None:
        if key != "score" and key not in names:
            raise RunStopped(f"reward.correct_key={key!r} is not a component of the reward "
                             f"(components: score{''.join(', ' + n for n in names)})")
        return key
    return next((c for c in CORRECT_COMPONENTS if c in names), "score")


def majority_index(answers: Sequence[Optional[str]]) -> Optional[int]:
    """Index of the first sample carrying the most common (normalised) answer; None when no
    sample has one. Ties go to the answer that appears first.

    >>> majority_index(["4", "5", " 5", None]), majority_index(["4", "5"]), majority_index([None, None])
    (1, 0, None)
    """
    keys = [normalize_answer(a) if a is not None else None for a in answers]
    counts = Counter(k for k in keys if k)
    if not counts:
        return None
    top = max(counts.values())
    return next(i for i, k in enumerate(keys) if k and counts[k] == top)


def at_n_metrics(groups: Sequence[Sequence[int]], correct: Sequence[bool], scores: Sequence[float],
                 answers: Sequence[Optional[str]], n: int) -> dict[str, float]:
    """mean@n, best@n, maj@n accuracy and best@n reward, averaged over ``groups`` (each the
    sample indices of one prompt)."""
    if not groups:
        return {}
    mean = best = maj = best_score = 0.0
    for g in groups:
        flags = [bool(correct[i]) for i in g]
        mean += sum(flags) / len(flags)
        best += float(any(flags))
        winner = majority_index([answers[i] for i in g])
        maj += float(winner is not None and flags[winner])
        best_score += max(scores[i] for i in g)
    k = len(groups)
    return {f"accuracy/mean@{n}": mean / k, f"accuracy/best@{n}": best / k, f"accuracy/maj@{n}": maj / k,
            f"reward/best@{n}": best_score / k}


def source_name(value: Any) -> str:
    """A source value as a key segment: ``/`` and whitespace become ``_`` (keys split on ``/``)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return UNKNOWN_SOURCE
    return re.sub(r"[/\s]+", "_", str(value).strip())


def group_indices(keys: Sequence[str]) -> dict[str, list[int]]:
    """Sample indices per key, keys in first-seen order."""
    out: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return out


class ValidationSplits:
    """Collects one validation's samples (every generate call of it) and turns them into the
    by-source and @n metrics; the overall means stay with the caller."""

    def __init__(self, *, n: int, source_key: str, extract: Callable[[str], Optional[str]],
                 correct_key: Optional[str] = None, correct_threshold: float = 1.0):
        self.n, self.source_key, self.extract = n, source_key, extract
        self.correct_key, self.correct_threshold = correct_key, correct_threshold
        self.uids: list[str] = []
        self.sources: list[Optional[str]] = []
        self.answers: list[Optional[str]] = []
        self.scores: list[float] = []
        self.components: list[dict[str, float]] = []
        self.lengths: list[float] = []
        self.episodes = Batch(fields={"agent_stats": [], "env_reward": []})  # multi-turn runs: each episode's counters

    @classmethod
    def from_config(cls, cfg: FitrlConfig) -> "ValidationSplits":
        r = cfg.reward
        return cls(n=cfg.rollout.val.n, source_key=cfg.data.source_key,
                   extract=lambda text: final_answer(r.function, text, r.kwargs),
                   correct_key=r.correct_key, correct_threshold=r.correct_threshold)

    def add_samples(self, *, uids: Sequence[str], extras: Sequence[dict], responses: Sequence[str],
                    scores: Sequence[float], components: dict[str, Sequence[float]], lengths: Sequence[float]) -> None:
        """One generate call's samples: prompt uid, the row's other columns (where the source
        column is), response text, score, components and response length of each."""
        self.uids += list(uids)
        self.sources += [e.get(self.source_key) if isinstance(e, dict) and self.source_key in e else None
                         for e in extras]
        self.answers += [self.extract(r) for r in responses]
        self.scores += [float(s) for s in scores]
        self.components += [{k: float(v[i]) for k, v in components.items()} for i in range(len(scores))]
        self.lengths += [float(x) for x in lengths]

    def add(self, out, scored) -> None:
        """From a rollout batch (fitrl/rollout/engine.py) and its :class:`~fitrl.roles.reward.Scored`."""
        self.add_samples(uids=out["uid"], extras=out["extra"], responses=out["response_text"],
                         scores=scored.scores.tolist(),
                         components={k: v.tolist() for k, v in scored.components.items()},
                         lengths=out["response_mask"].sum(-1).tolist())
        if "agent_stats" in out.fields:
            for k in ("agent_stats", "env_reward"):
                self.episodes.fields[k] += list(out[k])

    # ------------------------------------------------------------------ metrics
    def correct(self) -> list[bool]:
        names = sorted({k for c in self.components for k in c})
        key = correctness_key(names, self.correct_key)
        values = self.scores if key == "score" else [c.get(key, 0.0) for c in self.components]
        return [v >= self.correct_threshold for v in values]

    def metrics(self, prefix: str = "val/") -> dict[str, float]:
        if not self.scores:
            return {}
        correct = self.correct()
        m: dict[str, float] = {}
        if self.episodes["agent_stats"]:  # val/agent/turns, val/agent/tool_calls, ... (docs/metrics.md)
            m.update({prefix + k: v for k, v in agent_metrics(self.episodes).items()})
        if self.n > 1:
            groups = list(group_indices(self.uids).values())
            at_n = at_n_metrics(groups, correct, self.scores, self.answers, self.n)
            m.update({prefix + k: v for k, v in at_n.items()})
        if any(s is not None for s in self.sources):
            for source, idx in group_indices([source_name(s) for s in self.sources]).items():
                m.update(self._source_metrics(f"{prefix}by_source/{source}/", idx, correct))
        return m

    def _source_metrics(self, prefix: str, idx: list[int], correct: list[bool]) -> dict[str, float]:
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs)

        m = {prefix + "reward/mean": mean([self.scores[i] for i in idx]),
             prefix + "response/length_mean": mean([self.lengths[i] for i in idx]),
             prefix + "prompts": float(len({self.uids[i] for i in idx}))}
        for name in sorted({k for i in idx for k in self.components[i]}):
            m[f"{prefix}reward/{name}"] = mean([self.components[i].get(name, 0.0) for i in idx])
        if self.n > 1:
            groups = list(group_indices([self.uids[i] for i in idx]).values())
            groups = [[idx[j] for j in g] for g in groups]
            at_n = at_n_metrics(groups, correct, self.scores, self.answers, self.n)
            m.update({prefix + k: v for k, v in at_n.items()})
        return m


def summary(m: dict[str, float], n: int, prefix: str = "val/") -> str:
    """What the console's validation line adds: ``; mean@4 0.250 best@4 0.500 maj@4 0.250;
    by source: gsm8k 0.310 (8), math 0.120 (12)`` (reward mean and prompts per source)."""
    out = ""
    if f"{prefix}accuracy/mean@{n}" in m:
        out += "; " + " ".join(f"{k}@{n} {m[f'{prefix}accuracy/{k}@{n}']:.3f}" for k in ("mean", "best", "maj"))
    sources = [k[len(prefix + "by_source/"):-len("/reward/mean")] for k in m
               if k.startswith(prefix + "by_source/") and k.endswith("/reward/mean")]
    if sources:
        out += "; by source: " + ", ".join(
            f"{s} {m[f'{prefix}by_source/{s}/reward/mean']:.3f} ({int(m[f'{prefix}by_source/{s}/prompts'])})"
            for s in sources)
    return out
