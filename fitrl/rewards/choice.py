"""Reward for short closed answers: one word, digit or letter out of a few options
(``Which colour has more squares, red or blue?`` -> ``red``; the shapes toy task of
``examples/shapes_vl.yaml``).

Partial credit by spelling gives a random-initialised tiny model a gradient from the first step:
a response that is almost an option (``re``, ``blu``) earns part of the format credit, so it
first learns to answer with one short option and stop, then which option is right.
"""

from __future__ import annotations

import difflib
from typing import Any, Optional, Sequence


def normalise_choice(text: str) -> str:
    """The answer as compared: stripped, lower case, without trailing ``.``/``!``.

    >>> normalise_choice(" Red. ")
    'red'
    """
    return text.strip().rstrip(".!").strip().lower()


def choice_reward(response: str, answer: Any, *, choices: Optional[Sequence[Any]] = None,
                  extra: Optional[dict] = None, format_weight: float = 0.4,
                  exact_weight: float = 0.6) -> dict[str, float]:
    """Score a one-option answer. Returns ``score`` and its components, each in [0, 1].

    The options are ``choices`` (``reward.kwargs``), else the row's ``choices`` column
    (``extra``), else the answer alone. Responses and options compare after
    :func:`normalise_choice`.

    - ``format``: 1 when the response is one of the options, else its spelling similarity to the
      nearest one (``difflib`` ratio: twice the matched characters over the total length, so a
      long response earns little);
    - ``exact``: 1 when the response is the answer.

    >>> choice_reward("red", "red", choices=["red", "blue"])
    {'score': 1.0, 'format': 1.0, 'exact': 1.0}
    >>> choice_reward("Blue.", "red", extra={"choices": ["red", "blue"]})
    {'score': 0.4, 'format': 1.0, 'exact': 0.0}
    >>> choice_reward("re", "red", choices=["red", "blue"])      # 2 * 2 / (2 + 3) = 0.8
    {'score': 0.32, 'format': 0.8, 'exact': 0.0}
    >>> choice_reward("what a nice picture", "2", choices="1234")["score"]
    0.0
    """
    if choices is None and extra is not None:
        choices = extra.get("choices")
    options = [normalise_choice(str(c)) for c in (choices if choices else [answer])]
    text = normalise_choice(response)
    if text in options:
        fmt = 1.0
    else:
        fmt = max(difflib.SequenceMatcher(None, text, o, autojunk=False).ratio() for o in options)
    exact = float(text == normalise_choice(str(answer)))
    return {"score": round(format_weight * fmt + exact_weight * exact, 6), "format": round(fmt, 6), "exact": exact}
