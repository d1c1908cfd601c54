"""Finding a response's final answer, and deciding whether two answers are the same.

Pure functions over text. Equivalence is math-verify's (fractions, LaTeX, decimals, intervals,
sets, percentages, units), with its own signal-based timeout switched off: that timeout only
works on a main thread (frameworks calling it from threads have scored whole runs 0), and a
timed-out comparison comes back as a silent ``False``. The reward pool's per-call wall-clock
limit replaces it: a hung comparison is killed, counted in ``reward/timeouts`` and logged.
Without the pool (``num_workers=0``) nothing bounds the time.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "The final answer is", "Answer:", "answer =", GSM8K's "####".
_MARKER = re.compile(r"####|\banswer\s*(?:is\b\s*:?|:|=)", re.IGNORECASE)
# A marker's answer stops at the first plain word after it: "42 apples" -> "42".
_TRAILING_WORDS = re.compile(r"\s+(?=[A-Za-z]{2,}\b).*$", re.DOTALL)
_MATH_SPAN = re.compile(r"\$\$?(.+?)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_CHOICE = re.compile(r"^\(?([A-H])\)?(?:[.:)]|\s|$)")
_TAG_CACHE: dict[str, re.Pattern] = {}
# Markup that carries no answer: think/answer tags, \boxed, braces, dollars, whitespace.
_MARKUP = re.compile(r"<\s*/?\s*[A-Za-z_]+\s*>|\\(?:boxed|fbox|text)|[\s{}$\\]")


def extract_boxed(text: str) -> Optional[str]:
    r"""Content of the last non-empty ``\boxed{...}`` (balanced braces), or None.

    >>> extract_boxed(r"so $x = \boxed{\frac{1}{2}}$.")
    '\\frac{1}{2}'
    >>> extract_boxed(r"\boxed{1} then \boxed{ \{1, 2\} }")
    '\\{1, 2\\}'
    >>> extract_boxed("no box"), extract_boxed(r"\boxed{unclosed"), extract_boxed(r"\boxed{ }")
    (None, None, None)
    """
    for m in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            c = text[i]
            if c == "\\":                          # \{ and \} are literal braces, not grouping
                continue
            if c == "{" and text[i - 1] != "\\":
                depth += 1
            elif c == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    if text[start:i].strip():
                        return text[start:i].strip()
                    break
    return None


def extract_after_marker(text: str) -> Optional[str]:
    r"""The first non-blank line after the last answer marker, trimmed to the answer itself, or None.

    >>> extract_after_marker("3 + 4 = 7, so the answer is 7 apples.")
    '7'
    >>> extract_after_marker(r"**Final answer:** $\frac{1}{2}$ of the cake")
    '\\frac{1}{2}'
    >>> extract_after_marker("#### 1,000")
    '1,000'
    >>> extract_after_marker("The answer is") is None
    True
    """
    markers = list(_MARKER.finditer(text))
    if not markers:
        return None
    tail = text[markers[-1].end():].lstrip(" \t\r\n*").split("\n", 1)[0]
    span = _MATH_SPAN.search(tail)
    if span:
        tail = next(g for g in span.groups() if g is not None)
    else:
        tail = _TRAILING_WORDS.sub("", tail)
    tail = tail.strip().rstrip(".,;:!*").strip()
    return tail or None


def extract_final_answer(text: str) -> Optional[str]:
    r"""The last ``\boxed{}`` content, else the answer after the last marker, else None.

    >>> extract_final_answer(r"The answer is 3, no wait: \boxed{4}")
    '4'
    >>> extract_final_answer("I think 42") is None
    True
    """
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_after_marker(text)


def extract_tag(text: str, tag: str = "answer") -> Optional[str]:
    """Content of the last ``<tag>...</tag>``, stripped, or None.

    >>> extract_tag("<think>hmm</think> <answer> B </answer>")
    'B'
    >>> extract_tag("no tags") is None
    True
    """
    pattern = _TAG_CACHE.get(tag)
    if pattern is None:
        pattern = _TAG_CACHE[tag] = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
    found = pattern.findall(text)
    return found[-1].strip() if found else None


def choice_letter(text: str) -> Optional[str]:
    r"""The option letter a short answer names (A-H, capital), or None.

    >>> [choice_letter(s) for s in ["B", "(C)", "D. 3.5", r"\text{(A)}", "E) x", "a", "Because"]]
    ['B', 'C', 'D', 'A', 'E', None, None]
    """
    bare = re.sub(r"\\text\s*\{(.*?)\}", r"\1", text).replace("$", "").strip()
    m = _CHOICE.match(bare)
    return m.group(1) if m else None


def is_degenerate(response: str) -> bool:
    r"""True when a response has no letter or digit outside markup (tags, ``\boxed``, braces).

    Such a response cannot carry an answer; a reward that pays for it pays for format alone.

    >>> [is_degenerate(s) for s in ["", "  ", "<think></think><answer> </answer>", r"\boxed{}", "...", "7"]]
    [True, True, True, True, True, False]
    """
    return not any(c.isalnum() for c in _MARKUP.sub("", response))


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, list]:
    """Imported on first use: ~0.3 s of sympy the driver does not need when the pool scores."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass timeouts of None (see the module docstring); this silences math-verify's
    # once-per-process warning that the caller must then bound the time, which the pool does.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    config = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    return math_verify.parse, math_verify.verify, config


@functools.lru_cache(maxsize=4096)
def _parse(answer: str) -> list:
    parse, _, config = _math_verify()
    has_math = "$" in answer or "\\(" in answer or "\\[" in answer
    return parse(answer if has_math else f"${answer}$", extraction_config=config, parsing_timeout=None)


def warm_up() -> None:
    """Import math-verify and run one comparison (~0.4 s the first time in a process)."""
    math_equal("1/2", "0.5")


def math_equal(pred: str, gold: str) -> bool:
    r"""Whether ``pred`` is mathematically the same answer as ``gold`` (math-verify).

    Raises ValueError when the gold answer cannot be read: that is a data problem to report,
    not a wrong response to score 0.

    >>> math_equal("0.5", r"\frac{1}{2}"), math_equal("(1, 2]", "(1,2]"), math_equal(r"\{2,1\}", r"\{1,2\}")
    (True, True, True)
    >>> math_equal("3.01", "3"), math_equal("[1,2]", "(1,2]")
    (False, False)
    """
    gold_parsed = _parse(str(gold).strip())
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} cannot be parsed by math-verify")
    pred = pred.strip()
    if not pred:
        return False
    _, verify, _ = _math_verify()
    return bool(verify(gold_parsed, _parse(pred), timeout_seconds=None))


def same_answer(pred: Optional[str], gold: Any) -> bool:
    r"""Choice answers compare letters; everything else compares mathematically.

    >>> same_answer("(B)", "B"), same_answer("B. 3.5", "C"), same_answer(r"2\sqrt{3}", r"\sqrt{12}")
    (True, False, True)
    >>> same_answer(None, "B")
    False
    """
    if pred is None:
        return False
    gold = str(gold).strip()
    letter = choice_letter(gold)
    if letter is not None and len(gold) <= 3:        # "B", "(B)", "B."
        return choice_letter(pred) == letter
    return math_equal(pred, gold)
