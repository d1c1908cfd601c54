"""Reward of the toy arithmetic task shipped in ``examples/`` (``What is 3 + 4?`` -> ``7``).

Partial credit gives a random-initialised tiny model a gradient from the first step: it first
learns to answer with digits, then to stop after a short number, then to get it right.
"""

from __future__ import annotations

import re

_INT = re.compile(r"^-?\d{1,4}$")


def arith_reward(response: str, answer, *, format_weight: float = 0.3, closeness_weight: float = 0.3,
                 exact_weight: float = 0.4, max_chars: int = 4) -> dict[str, float]:
    """Score a response to an integer question. Returns ``score`` and its components, each in [0, 1].

    - ``digits``: share of the response's characters that are digits, times a brevity factor
      (a response of more than ``max_chars`` characters is scaled down by its excess length);
    - ``closeness``: for a bare integer, ``1 - |pred - answer| / 10`` floored at 0;
    - ``exact``: 1 when the bare integer equals the answer.

    >>> arith_reward("7", 7)["score"]
    1.0
    >>> arith_reward("8", 7)
    {'score': 0.57, 'digits': 1.0, 'closeness': 0.9, 'exact': 0.0}
    >>> arith_reward("the answer", 7)["score"]
    0.0
    """
    text = response.strip()
    target = int(answer)
    if text:
        digit_share = sum(c.isdigit() for c in text) / len(text)
        brevity = min(1.0, max_chars / len(text))
        digits = digit_share * brevity
    else:
        digits = 0.0
    closeness = exact = 0.0
    if _INT.match(text):
        value = int(text)
        closeness = max(0.0, 1.0 - abs(value - target) / 10.0)
        exact = float(value == target)
    score = format_weight * digits + closeness_weight * closeness + exact_weight * exact
    return {"score": round(score, 6), "digits": round(digits, 6), "closeness": round(closeness, 6), "exact": exact}
