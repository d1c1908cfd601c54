"""Built-in rule rewards: ``fn(response, answer, **weights) -> {"score": total, component: value}``.

Every component is in [0, 1] and the total is their weighted sum, so a run's ``reward/<component>``
curves say which part of the behaviour moved. Weights are keyword arguments, set from
``reward.kwargs`` (``reward.kwargs={accuracy_weight: 1.0, format_weight: 0.0}``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from fitrl.rewards.answers import extract_final_answer, extract_tag, same_answer
from fitrl.rewards.choice import normalise_choice

# Both parts must say something: an empty <think></think> or <answer></answer> earns no format credit.
_THINK_THEN_REST = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
_THINK_THEN_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def _split_think(response: str) -> tuple[bool, str]:
    """(well-formed ``<think>non-empty</think> non-empty rest``, the rest or the whole response)."""
    m = _THINK_THEN_REST.fullmatch(response)
    if m is None:
        return False, response
    return bool(m.group(1).strip() and m.group(2).strip()), m.group(2)


def math_reward(response: str, answer: Any, *, accuracy_weight: float = 0.9, format_weight: float = 0.1,
                think: bool = False) -> dict[str, float]:
    r"""Math: the final answer (last ``\boxed{}``, else after "the answer is" / "Answer:" / "####")
    checked against ``answer`` by math-verify.

    - ``accuracy``: 1 when the extracted answer equals ``answer`` (fractions, decimals, LaTeX,
      intervals, sets, percentages, units);
    - ``format``: 1 when a final answer was found (and, with ``think=True``, the response is
      ``<think>...</think>`` followed by the answer; the answer is then read after ``</think>``).

    >>> math_reward(r"1/4 + 1/4 = \boxed{\frac{1}{2}}", "0.5")
    {'score': 1.0, 'accuracy': 1.0, 'format': 1.0}
    >>> math_reward("So the answer is 0.75.", r"\frac{1}{2}")
    {'score': 0.1, 'accuracy': 0.0, 'format': 1.0}
    >>> math_reward("it is 0.5", "0.5")     # no box, no marker: nothing to grade
    {'score': 0.0, 'accuracy': 0.0, 'format': 0.0}
    >>> math_reward(r"<think>2+2</think> \boxed{4}", 4, think=True)["score"]
    1.0
    """
    well_formed, body = _split_think(response) if think else (True, response)
    pred = extract_final_answer(body)
    accuracy = float(same_answer(pred, answer))
    fmt = float(well_formed and pred is not None)
    return {"score": round(accuracy_weight * accuracy + format_weight * fmt, 6), "accuracy": accuracy, "format": fmt}


def r1v_reward(response: str, answer: Any, *, format_weight: float = 0.5) -> dict[str, float]:
    r"""Geometry and multiple choice, R1-V style: ``<think>...</think><answer>...</answer>``.

    - ``accuracy``: the ``<answer>`` content (else a ``\boxed{}`` / marker answer) equals ``answer``:
      option letters compare as letters ("(B)" is "B"), anything else by math-verify;
    - ``format``: the whole response is a non-empty think block then a non-empty answer block.

    >>> r1v_reward("<think>angle sum</think><answer>(B)</answer>", "B")
    {'score': 1.0, 'accuracy': 1.0, 'format': 1.0}
    >>> r1v_reward(r"<think>...</think><answer>2\sqrt{3}</answer>", r"\sqrt{12}")["accuracy"]
    1.0
    >>> r1v_reward(r"\boxed{C}", "B")
    {'score': 0.0, 'accuracy': 0.0, 'format': 0.0}
    """
    m = _THINK_THEN_ANSWER.fullmatch(response)
    fmt = float(m is not None and bool(m.group(1).strip()) and bool(m.group(2).strip()))
    pred = extract_tag(response, "answer")
    if pred is None:
        pred = extract_final_answer(response)
    accuracy = float(same_answer(pred, answer))
    return {"score": round((1 - format_weight) * accuracy + format_weight * fmt, 6),
            "accuracy": accuracy, "format": fmt}


def think_format_reward(response: str, answer: Any = None, *, answer_tags: bool = False) -> dict[str, float]:
    """Format alone: a non-empty ``<think>...</think>`` then a non-empty answer
    (inside ``<answer>...</answer>`` when ``answer_tags=True``). ``answer`` is not used.

    >>> think_format_reward("<think>2+2 is 4</think> 4")
    {'score': 1.0, 'format': 1.0}
    >>> think_format_reward("<think></think> 4")["score"], think_format_reward("<think>x</think>")["score"]
    (0.0, 0.0)
    >>> think_format_reward("<think>x</think>4", answer_tags=True)["score"]
    0.0
    """
    if answer_tags:
        m = _THINK_THEN_ANSWER.fullmatch(response)
        ok = m is not None and bool(m.group(1).strip()) and bool(m.group(2).strip())
    else:
        ok = _split_think(response)[0]
    return {"score": float(ok), "format": float(ok)}


def final_answer(reward: str, response: str, kwargs: Optional[dict[str, Any]] = None) -> Optional[str]:
    r"""The answer ``response`` gives, read as the built-in reward ``reward`` reads it; for any
    other function the last ``\boxed{}`` / marker answer, else the whole stripped response.
    Majority voting over a prompt's n validation samples counts these (fitrl/trainer/validation.py).

    >>> final_answer("arith", " 7 "), final_answer("math", r"so \boxed{4}."), final_answer("r1v", "<answer>B</answer>")
    ('7', '4', 'B')
    >>> final_answer("choice", " Red.")
    'red'
    >>> final_answer("math", "no answer here") is None, final_answer("my.py:fn", "just 12")
    (True, 'just 12')
    """
    kwargs = kwargs or {}
    if reward == "arith":
        return response.strip() or None
    if reward == "choice":
        return normalise_choice(response) or None
    if reward == "math":
        body = _split_think(response)[1] if kwargs.get("think") else response
        return extract_final_answer(body)
    if reward == "r1v":
        pred = extract_tag(response, "answer")
        return pred if pred is not None else extract_final_answer(response)
    pred = extract_final_answer(response)
    return pred if pred is not None else (response.strip() or None)
