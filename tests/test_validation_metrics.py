"""Validation split by data source and @n metrics (fitrl/trainer/validation.py), on hand-computed
examples and in a real validation over a two-source file."""

import doctest
import json

import pytest

import fitrl.trainer.validation
from fitrl.core.errors import RunStopped
from fitrl.trainer.validation import (ValidationSplits, at_n_metrics, correctness_key, majority_index,
                                      source_name, summary)
from helpers import read_metrics, toy_config

# Three prompts, n = 4 samples each. Correct = the `accuracy` component.
#   A (gsm8k): correct 1 0 0 1, answers 4 5 5 4 -> tie 2-2, "4" seen first and correct: maj 1
#   B (math):  correct 0 0 1 0, answers 7 7 8 -   -> "7" wins (2 votes, "-" does not vote), wrong: maj 0
#   C (math):  correct 0 0 0 0, no answers at all -> maj 0
UIDS = ["A"] * 4 + ["B"] * 4 + ["C"] * 4
SOURCES = ["gsm8k"] * 4 + ["math/hard"] * 8
ANSWERS = ["4", "5", "5", "4", "7", "7", "8", None, None, None, None, None]
CORRECT = [1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0]
SCORES = [1.0, 0.2, 0.2, 1.0, 0.1, 0.1, 0.9, 0.0, 0.0, 0.0, 0.0, 0.05]
LENGTHS = [2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8]


def test_doctests():
    result = doctest.testmod(fitrl.trainer.validation)
    assert result.attempted > 0 and result.failed == 0


def test_majority_vote_rules():
    assert majority_index(["4", "5", "5", "4"]) == 0          # tie: the answer seen first
    assert majority_index(["7", "7", "8", None]) == 0
    assert majority_index([None, "$8$", "8.", "9"]) == 1      # normalised: $8$ and 8. are the same
    assert majority_index([None, None]) is None


def test_at_n_by_hand():
    groups = [list(range(4)), list(range(4, 8)), list(range(8, 12))]
    m = at_n_metrics(groups, [bool(c) for c in CORRECT], SCORES, ANSWERS, n=4)
    assert m["accuracy/mean@4"] == pytest.approx((2 / 4 + 1 / 4 + 0) / 3)    # 0.25
    assert m["accuracy/best@4"] == pytest.approx(2 / 3)                      # A and B have a correct one
    assert m["accuracy/maj@4"] == pytest.approx(1 / 3)                       # only A's majority is right
    assert m["reward/best@4"] == pytest.approx((1.0 + 0.9 + 0.05) / 3)       # 0.65


def _splits(n=4, **kw):
    answers = iter(ANSWERS)
    splits = ValidationSplits(n=n, source_key="data_source", extract=lambda _text: next(answers), **kw)
    # two generate calls, as validation batches arrive
    for sl in (slice(0, 6), slice(6, 12)):
        splits.add_samples(uids=UIDS[sl], extras=[{"data_source": s, "level": 1} for s in SOURCES[sl]],
                           responses=["text"] * len(UIDS[sl]), scores=SCORES[sl],
                           components={"accuracy": CORRECT[sl], "format": [1.0] * len(UIDS[sl])},
                           lengths=LENGTHS[sl])
    return splits


def test_split_by_source_by_hand():
    m = _splits().metrics(prefix="val/")
    assert m["val/accuracy/mean@4"] == pytest.approx(0.25)
    assert m["val/accuracy/maj@4"] == pytest.approx(1 / 3)
    g, h = "val/by_source/gsm8k/", "val/by_source/math_hard/"      # "/" in a source becomes "_"
    assert m[g + "prompts"] == 1 and m[h + "prompts"] == 2
    assert m[g + "reward/mean"] == pytest.approx((1.0 + 0.2 + 0.2 + 1.0) / 4)          # 0.6
    assert m[h + "reward/mean"] == pytest.approx((0.1 + 0.1 + 0.9 + 0.05) / 8)         # 0.14375
    assert m[g + "reward/accuracy"] == pytest.approx(0.5) and m[h + "reward/accuracy"] == pytest.approx(1 / 8)
    assert m[g + "reward/format"] == 1.0
    assert m[g + "response/length_mean"] == 2 and m[h + "response/length_mean"] == 6
    assert (m[g + "accuracy/mean@4"], m[g + "accuracy/best@4"], m[g + "accuracy/maj@4"]) == (0.5, 1.0, 1.0)
    assert m[h + "accuracy/mean@4"] == pytest.approx((0.25 + 0) / 2)
    assert (m[h + "accuracy/best@4"], m[h + "accuracy/maj@4"]) == (0.5, 0.0)
    assert m[h + "reward/best@4"] == pytest.approx((0.9 + 0.05) / 2)
    text = summary(m, 4)
    assert text == "; mean@4 0.250 best@4 0.667 maj@4 0.333; by source: gsm8k 0.600 (1), math_hard 0.144 (2)"


def test_correctness_threshold_and_key():
    # by score >= 0.95 instead of `accuracy`: A's two 1.0 count, B's 0.9 no longer does
    m = _splits(correct_key="score", correct_threshold=0.95).metrics()
    assert m["val/accuracy/best@4"] == pytest.approx(1 / 3)
    assert correctness_key(["format", "exact"], None) == "exact"
    assert correctness_key(["accuracy", "exact"], None) == "accuracy"
    assert correctness_key(["digits"], None) == "score"
    with pytest.raises(RunStopped, match="reward.correct_key='acc' is not a component"):
        correctness_key(["accuracy"], "acc")


def test_single_sample_and_no_source_column():
    splits = ValidationSplits(n=1, source_key="data_source", extract=lambda t: t)
    splits.add_samples(uids=["a", "b"], extras=[{}, {}], responses=["1", "2"], scores=[1.0, 0.0],
                       components={}, lengths=[1, 1])
    assert splits.metrics() == {}                        # n = 1 and no source column: nothing beyond the means
    assert source_name(None) == "unknown" and source_name(" my set/v2 ") == "my_set_v2"


def test_validation_run_with_two_sources(tiny_model_dir, tmp_path):
    """A real validation, n = 2 sampled responses per prompt, over a toy file with two sources and
    a reward that pays one source only: the split must keep them apart."""
    from fitrl.trainer.run import train

    val = tmp_path / "val.jsonl"
    rows = [{"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b,
             "data_source": "easy" if a < 3 else "hard"} for a, b in [(1, 2), (2, 2), (3, 4), (5, 4), (6, 1)]]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = tmp_path / "by_source.py"
    reward.write_text("def fn(response, answer, extra):\n"
                      "    ok = float(extra['data_source'] == 'easy')\n"
                      "    return {'score': ok, 'accuracy': ok}\n")
    run_dir = tmp_path / "run"
    train(toy_config(tiny_model_dir, run_dir, "trainer.val_only=true", f"data.val_files=[{val}]",
                     "rollout.val.n=2", "rollout.val.temperature=1.0", f"reward.function={reward}:fn",
                     "reward.num_workers=0"))
    (m,) = read_metrics(run_dir)
    e, h = "val/by_source/easy/", "val/by_source/hard/"
    assert (m[e + "prompts"], m[h + "prompts"]) == (2, 3)
    assert (m[e + "reward/mean"], m[h + "reward/mean"]) == (1.0, 0.0)
    assert (m[e + "accuracy/mean@2"], m[e + "accuracy/best@2"]) == (1.0, 1.0)
    assert (m[h + "accuracy/mean@2"], m[h + "accuracy/best@2"], m[h + "accuracy/maj@2"]) == (0.0, 0.0, 0.0)
    assert m["val/accuracy/best@2"] == pytest.approx(2 / 5) and m["val/reward/mean"] == pytest.approx(2 / 5)
    assert m["val/accuracy/maj@2"] <= m["val/accuracy/best@2"]
