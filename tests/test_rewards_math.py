"""Answer verdicts: what the math, choice/geometry and format rewards accept, on hand-written pairs."""

import pytest

from fitrl.rewards.answers import extract_final_answer, math_equal
from fitrl.rewards.rules import math_reward, r1v_reward, think_format_reward

# (response, gold answer, is the response's final answer correct?)
MATH_TABLE = [
    # LaTeX fractions vs decimals, \frac vs /
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{1/2}", r"\frac12", True),
    (r"\boxed{\dfrac{3}{4}}", "0.75", True),
    (r"The final answer is $\frac{7}{2}$.", "3.5", True),
    (r"the answer is \(\frac{2}{3}\)", "2/3", True),
    (r"\boxed{0.33}", r"\frac{1}{3}", False),             # not within rounding
    (r"\boxed{3.0}", "3", True),
    (r"\boxed{3.01}", "3", False),
    (r"\boxed{12}", "12.5", False),
    # plain integers with text around them, markers, the last box wins
    ("The answer is 42.", "42", True),
    ("So there are 42 apples in total. Answer: 42 apples", "42", True),
    ("#### 1,000", "1000", True),
    (r"\boxed{1{,}000}", "1000", True),
    (r"**Final Answer:** $\boxed{8}$", 8, True),           # an int answer column
    ("I counted 41 first, but the answer is 42", "41", False),
    (r"We get 7 and 9, so \boxed{16}", "16", True),
    (r"\boxed{\frac{1}{2}} wait, no: \boxed{\frac{1}{3}}", "1/3", True),
    ("The answer is -7", "7", False),
    ("The answer is 3 or 4", "4", False),                 # the answer is the first thing after the marker
    ("42", "42", False),                                  # no box, no marker: nothing to grade
    ("", "42", False),
    (r"\boxed{}", "42", False),
    # intervals, sets, tuples
    (r"\boxed{(1, 2]}", "(1,2]", True),
    (r"\boxed{[1, 2]}", "(1,2]", False),
    (r"\boxed{(-\infty, 2)}", r"(-\infty,2)", True),
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", True),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", False),
    (r"\boxed{(3, -2)}", "(3,-2)", True),
    (r"\boxed{(2, 3)}", "(3,2)", False),
    # units, percent, degrees
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"The answer is $5$ cm.", "5", True),
    (r"\boxed{10\%}", "10", True),
    (r"\boxed{90^\circ}", "90", True),
    # radicals, symbols, expressions, equations, text
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", True),
    (r"\boxed{\pi}", r"\pi", True),
    (r"\boxed{3.14}", r"\pi", False),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
    (r"\boxed{x = 3}", "3", True),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", True),
]


@pytest.mark.parametrize("response,answer,correct", MATH_TABLE)
def test_math_answer_table(response, answer, correct):
    out = math_reward(response, answer)
    assert out["accuracy"] == float(correct)
    assert out["score"] == pytest.approx(0.9 * out["accuracy"] + 0.1 * out["format"])


def test_math_table_is_big_and_balanced():
    assert len(MATH_TABLE) >= 30
    assert 10 <= sum(not c for *_, c in MATH_TABLE) <= len(MATH_TABLE) - 10


def test_math_format_and_think():
    assert math_reward("it is 4", "4") == {"score": 0.0, "accuracy": 0.0, "format": 0.0}
    assert math_reward(r"\boxed{5}", "4") == {"score": 0.1, "accuracy": 0.0, "format": 1.0}
    think = {"think": True, "accuracy_weight": 0.5, "format_weight": 0.5}
    assert math_reward(r"<think>2+2</think>\boxed{4}", "4", **think)["score"] == 1.0
    assert math_reward(r"\boxed{4}", "4", **think) == {"score": 0.5, "accuracy": 1.0, "format": 0.0}
    assert math_reward(r"<think></think>\boxed{4}", "4", **think)["format"] == 0.0   # empty thinking
    # with think=True the answer is read after </think>, not from a box inside the thinking
    assert math_reward(r"<think>\boxed{4}?</think>The answer is 5", "4", **think)["accuracy"] == 0.0


def test_unreadable_gold_answer_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="gold answer '' cannot be parsed"):
        math_equal("1", "")


@pytest.mark.parametrize("text,answer", [
    (r"\boxed{\frac{a}{b}}", r"\frac{a}{b}"),
    (r"$\boxed{\{1, 2\}}$", r"\{1, 2\}"),
    ("Answer: **17**", "17"),
    ("answer = 3.5 km", "3.5"),
    ("answer = x + 1", "x + 1"),
    ("The answer is: (B)", "(B)"),
    ("The answer is:\n\n$$x = 7$$\n\nDone.", "x = 7"),      # blank lines after the marker are skipped
    ("The answer is", None),
])
def test_extraction(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize("response,answer,accuracy,fmt", [
    ("<think>angles sum to 180</think><answer>B</answer>", "B", 1, 1),
    ("<think>...</think>\n<answer>(C)</answer>", "C", 1, 1),
    ("<think>...</think><answer>C. 3.5</answer>", "(C)", 1, 1),
    ("<think>...</think><answer>D</answer>", "C", 0, 1),
    (r"<think>...</think><answer>2\sqrt{3}</answer>", r"\sqrt{12}", 1, 1),     # geometry: numbers by math-verify
    ("<think>...</think><answer>30</answer>", "30^\\circ", 1, 1),
    ("<think>...</think><answer>31</answer>", "30", 0, 1),
    (r"\boxed{B}", "B", 1, 0),                                                   # right, wrong format
    ("<think></think><answer>B</answer>", "B", 1, 0),                          # empty thinking: no format credit
    ("<think>hmm</think><answer> </answer>", "B", 0, 0),
    ("B is my guess", "B", 0, 0),                                                 # no tag, box or marker
])
def test_r1v_table(response, answer, accuracy, fmt):
    out = r1v_reward(response, answer)
    assert (out["accuracy"], out["format"]) == (accuracy, fmt)
    assert out["score"] == pytest.approx(0.5 * accuracy + 0.5 * fmt)


@pytest.mark.parametrize("response,tags,ok", [
    ("<think>reasoning</think>\nThe answer is 4.", False, True),
    ("  <think>reasoning</think><answer>4</answer>", True, True),
    ("<think>reasoning</think>", False, False),               # nothing after the thinking
    ("<think> </think>4", False, False),
    ("4<think>late</think>4", False, False),                   # must start with the thinking
    ("<think>a</think>4", True, False),                        # answer tags required
    ("<think>a</think><answer>4</answer> trailing", True, False),
])
def test_think_format_table(response, tags, ok):
    assert think_format_reward(response, None, answer_tags=tags) == {"score": float(ok), "format": float(ok)}
