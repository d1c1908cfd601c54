"""Mixing reward sources (``reward.sources``) and reading a judge's grade: pure functions.

A run's reward is ``sum_i weight_i * score_i`` over its sources (rule functions, reward models,
LLM judges: fitrl/roles/model_reward.py runs the models), each source's score standardised
first where it asks (``normalize: batch``): a reward model's raw logits have no fixed scale, and
a weight means what it says only between scores of comparable spread.
"""

from __future__ import annotations

import math
import re
from typing import Optional

import torch

STD_FLOOR = 1e-6
"""Below this spread a batch's scores are one value: standardised to 0, not divided by ~0."""


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """(B,) scores to mean 0 and (population) std 1 over the batch; all zeros when they are all equal."""
    centred = scores - scores.mean()
    std = scores.std(unbiased=False) if scores.numel() > 1 else scores.new_zeros(())
    return centred / std if std > STD_FLOOR else torch.zeros_like(scores)


def weighted_total(scores: dict[str, torch.Tensor], weights: dict[str, float],
                   normalize: Optional[dict[str, str]] = None) -> torch.Tensor:
    """``sum_i weights[i] * s_i`` with ``s_i`` = ``scores[i]``, standardised where ``normalize[i]``
    is ``"batch"``; every entry (B,) float. Keys must agree."""
    if set(scores) != set(weights):
        raise ValueError(f"scores for {sorted(scores)} but weights for {sorted(weights)}")
    normalize = normalize or {}
    total = None
    for name, s in scores.items():
        part = weights[name] * (standardise(s) if normalize.get(name, "none") == "batch" else s.float())
        total = part if total is None else total + part
    if total is None:
        raise ValueError("weighted_total needs at least one source")
    return total


def parse_grade(reply: str, pattern: str | re.Pattern, max_score: float) -> Optional[float]:
    """The grade in a judge's ``reply``: the first match of ``pattern``'s first group, as a number,
    divided by ``max_score``; None when nothing matches or the group is no finite number."""
    m = re.search(pattern, reply)
    if m is None or m.group(1) is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return value / max_score if math.isfinite(value) else None
