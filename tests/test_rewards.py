import doctest

import pytest
import torch

import fitrl.rewards.arith as arith_module
from fitrl.config.schema import ConfigError, RewardConfig
from fitrl.rewards.arith import arith_reward
from fitrl.rewards.registry import RewardError, RewardScorer


def test_arith_doctests():
    assert doctest.testmod(arith_module).failed == 0


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
    scores, comps = RewardScorer(RewardConfig("arith")).score(["7", "x"], [7, 7])
    assert scores.tolist() == [1.0, 0.0] and comps["exact"].tolist() == [1.0, 0.0]
    f = tmp_path / "my_reward.py"
    f.write_text("def length_reward(response, answer, scale=1.0):\n    return scale * len(response)\n")
    scorer = RewardScorer(RewardConfig(f"{f}:length_reward", {"scale": 0.5}))
    assert scorer.score(["abcd"], [None])[0].tolist() == [2.0]


def test_scorer_errors_are_loud(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def boom(response, answer):\n    raise ValueError('bad input')\n"
                 "def wrong(response, answer):\n    return 'high'\n")
    with pytest.raises(RewardError, match=r"boom raised ValueError: bad input on response 'hi'.*prompt a.jsonl:3"):
        RewardScorer(RewardConfig(f"{f}:boom")).score(["hi"], [1], ["a.jsonl:3"])
    with pytest.raises(RewardError, match="wrong returned str"):
        RewardScorer(RewardConfig(f"{f}:wrong")).score(["hi"], [1])
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        RewardScorer(RewardConfig(f"{f}:missing"))
    with pytest.raises(ConfigError, match="cannot be called"):
        RewardScorer(RewardConfig("arith", {"no_such_option": 1}))
    with pytest.raises(ConfigError, match="neither a built-in"):
        RewardScorer(RewardConfig("arithh"))
