"""Reward functions and the scorer in-process (``num_workers=0``): fast, no worker processes.

The worker pool (time limits, hung and dying workers) is in ``test_rewards_pool.py``; the math
answer table in ``test_rewards_math.py``.
"""

import doctest
import logging

import pytest
import torch

import fitrl.rewards.answers
import fitrl.rewards.arith
import fitrl.rewards.choice
import fitrl.rewards.functions
import fitrl.rewards.rules
from fitrl.config.schema import ConfigError, RewardConfig
from fitrl.rewards.arith import arith_reward
from fitrl.roles.reward import RewardError, RewardScorer


def reward_cfg(function, kwargs=None, **options):
    """A RewardConfig (its options validated as the config loader would)."""
    return RewardConfig(function, dict(kwargs or {}), **options)


@pytest.mark.parametrize("module", [fitrl.rewards.arith, fitrl.rewards.answers, fitrl.rewards.rules,
                                    fitrl.rewards.functions, fitrl.rewards.choice], ids=lambda m: m.__name__)
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("response,answer,score", [
    ("7", 7, 1.0),                 # all three components
    (" 12 ", 12, 1.0),             # surrounding whitespace is fine
    ("17", 7, 0.3),                # digits only: 10 away, no closeness
    ("", 3, 0.0),
    ("ab12", 12, 0.3 * 0.5),       # half digits, not a bare integer
    ("12345678", 5, 0.3 * 0.5),    # all digits but 2x too long, and not <= 4 digits
])
def test_arith_reward_table(response, answer, score):
    assert arith_reward(response, answer)["score"] == pytest.approx(score)


def test_scorer_components_and_custom_file(tmp_path):
    out = RewardScorer(reward_cfg("arith", num_workers=0)).score(["7", "x"], [7, 7])
    scores, comps = out.scores, out.components
    assert scores.tolist() == [1.0, 0.0] and comps["exact"].tolist() == [1.0, 0.0]
    f = tmp_path / "my_reward.py"
    f.write_text("def length_reward(response, answer, scale=1.0):\n    return scale * len(response)\n")
    scorer = RewardScorer(reward_cfg(f"{f}:length_reward", {"scale": 0.5}, num_workers=0))
    assert scorer.score(["abcd"], [None]).scores.tolist() == [2.0]


def test_builtin_math_through_the_scorer():
    scorer = RewardScorer(reward_cfg("math", {"format_weight": 0.0, "accuracy_weight": 1.0}, num_workers=0))
    out = scorer.score([r"\boxed{0.5}", "The answer is 3.", "no idea"], [r"\frac12", "4", "1"])
    scores, comps = out.scores, out.components
    assert scores.tolist() == [1.0, 0.0, 0.0] and comps["format"].tolist() == [1.0, 1.0, 0.0]
    assert out.health["reward/errors"] == 0 and out.health["reward/timeouts"] == 0


def test_extras_reach_functions_that_ask_for_them(tmp_path):
    f = tmp_path / "extra_reward.py"
    f.write_text("def per_sample(response, answer, extra, bonus=0.0):\n    return extra['weight'] + bonus\n"
                 "def batched(responses, answers, extras):\n"
                 "    return [{'score': e['weight'], 'w': 1} for e in extras]\n"
                 "def no_extra(response, answer):\n    return 1.0\n")
    extras = [{"weight": 0.25}, {"weight": 0.5}]
    one = RewardScorer(reward_cfg(f"{f}:per_sample", {"bonus": 1.0}, num_workers=0))
    assert one.score(["a", "b"], [0, 0], extras=extras).scores.tolist() == [1.25, 1.5]
    many = RewardScorer(reward_cfg(f"{f}:batched", batched=True, num_workers=0))
    out = many.score(["a", "b"], [0, 0], extras=extras)
    scores, comps = out.scores, out.components
    assert scores.tolist() == [0.25, 0.5] and comps["w"].tolist() == [1.0, 1.0]
    plain = RewardScorer(reward_cfg(f"{f}:no_extra", num_workers=0))       # extras are offered, not forced
    assert plain.score(["a"], [0], extras=[{"weight": 9}]).scores.tolist() == [1.0]
    with pytest.raises(ValueError, match="2 responses but 1 extras"):
        plain.score(["a", "b"], [0, 0], extras=[{}])


def test_raising_function_gets_fallback_counted_and_logged_once(tmp_path, caplog):
    f = tmp_path / "picky.py"
    f.write_text("def picky(response, answer):\n    if response == 'bad':\n        raise ValueError('cannot read')\n"
                 "    return 1.0\n")
    scorer = RewardScorer(reward_cfg(f"{f}:picky", num_workers=0, fallback_score=-1.0))
    with caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        scores = scorer.score(["ok", "bad", "ok", "bad", "ok"], [1] * 5, [f"a.jsonl:{i}" for i in range(5)]).scores
        again = scorer.score(["bad", "ok", "ok"], [1] * 3)
    assert scores.tolist() == [1.0, -1.0, 1.0, -1.0, 1.0]
    assert again.health["reward/errors"] == 1.0
    logged = [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
    assert len(logged) == 1          # the same input (response, answer) is logged once per run
    assert "ValueError: cannot read" in logged[0] and "'bad'" in logged[0] and "a.jsonl:1" in logged[0]


def test_scorer_errors_are_loud(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def boom(response, answer):\n    raise ValueError('bad input')\n"
                 "def wrong(response, answer):\n    return 'high'\n"
                 "def no_score(response, answer):\n    return {'accuracy': 1.0}\n"
                 "def text_part(response, answer):\n    return {'score': 1.0, 'note': 'good'}\n"
                 "def nan(response, answer):\n    return float('nan')\n"
                 "def short(responses, answers):\n    return [1.0]\n"
                 "def scalar(responses, answers):\n    return 1.0\n")
    # More than max_error_fraction of the batch raising is a broken function: stop, with the sample.
    with pytest.raises(RewardError, match=r"boom raised ValueError: bad input on response 'hi'.*prompt a.jsonl:3"):
        RewardScorer(reward_cfg(f"{f}:boom", num_workers=0)).score(["hi"], [1], ["a.jsonl:3"])
    for name, message in [("wrong", "wrong returned str"), ("no_score", "no_score returned a dict without 'score'"),
                          ("text_part", "text_part returned note='good'")]:
        with pytest.raises(RewardError, match=message):
            RewardScorer(reward_cfg(f"{f}:{name}", num_workers=0)).score(["hi"], [1])
    nan = RewardScorer(reward_cfg(f"{f}:nan", num_workers=0, max_error_fraction=1.0))
    out = nan.score(["hi"], [1])
    assert out.scores.tolist() == [0.0] and out.health["reward/errors"] == 1.0
    with pytest.raises(RewardError, match="nan raised ValueError: score is nan on response 'hi'"):
        RewardScorer(reward_cfg(f"{f}:nan", num_workers=0)).score(["hi"], [1])
    with pytest.raises(RewardError, match="batched reward function .*short returned 1 results for 2 responses"):
        RewardScorer(reward_cfg(f"{f}:short", batched=True, num_workers=0)).score(["a", "b"], [1, 1])
    with pytest.raises(RewardError, match="batched reward function .*scalar returned float"):
        RewardScorer(reward_cfg(f"{f}:scalar", batched=True, num_workers=0)).score(["a"], [1])


def test_a_failing_batched_call_fails_its_whole_batch_once(tmp_path, caplog):
    f = tmp_path / "batch_boom.py"
    f.write_text("def boom(responses, answers):\n    raise RuntimeError('service down')\n")
    with pytest.raises(RewardError, match="boom raised RuntimeError: service down.*3 of 3 responses raised"):
        RewardScorer(reward_cfg(f"{f}:boom", batched=True, num_workers=0)).score(["a", "b", "c"], [1] * 3)
    tolerant = RewardScorer(reward_cfg(f"{f}:boom", batched=True, num_workers=0, max_error_fraction=1.0,
                                       fallback_score=0.5))
    with caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        out = tolerant.score(["a", "b", "c"], [1] * 3)
        assert out.scores.tolist() == [0.5] * 3
    assert out.health["reward/errors"] == 3.0
    logged = [r.getMessage() for r in caplog.records if "fallback_score=0.5" in r.getMessage()]
    assert len(logged) == 1 and "a batch of 3 responses (the first: response 'a'" in logged[0]


def test_startup_checks(tmp_path):
    f = tmp_path / "sig.py"
    f.write_text("def two(response, answer):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        RewardScorer(reward_cfg(f"{f}:missing"))
    with pytest.raises(ConfigError, match="file not found"):
        RewardScorer(reward_cfg(f"{tmp_path}/nope.py:fn"))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg.rewards'"):
        RewardScorer(reward_cfg("no_such_pkg.rewards:fn"))
    with pytest.raises(ConfigError, match="cannot be called"):
        RewardScorer(reward_cfg("arith", {"no_such_option": 1}))
    with pytest.raises(ConfigError, match=r"cannot be called as fn\(responses, answers.*batched=true"):
        RewardScorer(reward_cfg(f"{f}:two", {"scale": 2}, batched=True))
    with pytest.raises(ConfigError, match="neither a built-in"):
        RewardScorer(reward_cfg("arithh"))
    with pytest.raises(ConfigError, match="built-in reward 'math' scores one response"):
        RewardScorer(reward_cfg("math", batched=True))
    with pytest.raises(ConfigError, match="reward.timeout must be > 0"):
        RewardScorer(reward_cfg("math", timeout=0))
    with pytest.raises(ConfigError, match="reward.max_error_fraction"):
        RewardScorer(reward_cfg("math", max_error_fraction=2))


def test_degenerate_answers_with_positive_reward_are_flagged_once(tmp_path, caplog):
    f = tmp_path / "generous.py"
    f.write_text("def generous(response, answer):\n    return 0.1\n")
    scorer = RewardScorer(reward_cfg(f"{f}:generous", num_workers=0))
    with caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        first = scorer.score(["", "<think> </think><answer></answer>", "42", "\\boxed{}"], [0] * 4).health
        second = scorer.score(["", "x"], [0] * 2).health
    assert first["reward/degenerate"] == 0.75 and first["reward/degenerate_positive"] == 0.75
    assert second["reward/degenerate_positive"] == 0.5
    warnings = [r.getMessage() for r in caplog.records if "format hacking" in r.getMessage()]
    assert len(warnings) == 1 and "3 of 3 empty or degenerate" in warnings[0]
    # The built-in math reward pays nothing for an empty box: no flag.
    math_scorer = RewardScorer(reward_cfg("math", num_workers=0))
    health = math_scorer.score(["", "\\boxed{}", "<think></think>"], ["1"] * 3).health
    assert health["reward/degenerate_positive"] == 0.0


def test_scores_are_float32_tensors():
    out = RewardScorer(reward_cfg("arith", num_workers=0)).score(["7"], [7])
    scores, comps = out.scores, out.components
    assert scores.dtype == torch.float32 and all(v.dtype == torch.float32 for v in comps.values())
