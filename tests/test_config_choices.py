"""Registry-backed names are checked when the config loads: a misspelt estimator, loss,
aggregation, KL estimator, reward function or rollout engine exits 2 with one line naming the
valid choices, before any model loads and before a run directory exists."""

from __future__ import annotations

import pytest

from fitrl.cli import main
from fitrl.config import ConfigError, load_config
from fitrl.config.choices import algorithm_needs

TYPOS = [
    ("algorithm.adv_estimator=grpoo", "unknown advantage estimator algorithm.adv_estimator='grpoo'; did you mean 'grpo'?",
     "drgrpo, gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo"),
    ("algorithm.policy_loss=ppo_clipp", "unknown policy loss algorithm.policy_loss='ppo_clipp'", "cispo, gspo, ppo_clip"),
    ("algorithm.loss_agg_mode=token_mean", "unknown loss aggregation algorithm.loss_agg_mode='token_mean'",
     "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"),
    ("algorithm.kl_estimator=k33", "unknown KL estimator algorithm.kl_estimator='k33'", "abs, k1, k2, k3, low_var_kl, mse"),
    ("algorithm.kl_in_reward.estimator=kl", "unknown KL estimator algorithm.kl_in_reward.estimator='kl'", "k1, k2"),
    ("critic.loss_agg_mode=token", "unknown loss aggregation critic.loss_agg_mode='token'", "token-mean"),
    ("reward.function=arithm", "unknown reward function reward.function='arithm'; did you mean 'arith'?",
     "arith, by_source, choice, math, r1v, think_format"),
    ("rollout.engine=vlm", "unknown rollout engine rollout.engine='vlm'; did you mean 'vllm'?", "hf, vllm"),
]


@pytest.mark.parametrize("override,message,valid", TYPOS, ids=[t[0].split("=")[0] for t in TYPOS])
def test_misspelt_name_exits_2_with_one_line_before_anything_loads(tmp_path, capsys, override, message, valid):
    # The model path does not exist: were the name checked after the model loads, that error would come first.
    code = main(["train", "examples/arith.yaml", override, f"trainer.output_dir={tmp_path / 'runs'}",
                 "actor.model.path=/nonexistent/model"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fitrl: config error: "), err
    assert message in lines[0] and valid in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()  # no run directory was created


def test_fitrl_config_shows_the_same_error(capsys):
    assert main(["config", "examples/arith.yaml", "algorithm.adv_estimator=grpoo"]) == 2
    assert "unknown advantage estimator algorithm.adv_estimator='grpoo'" in capsys.readouterr().err


def test_structural_errors_come_before_name_checks():
    with pytest.raises(ConfigError, match="unknown config key 'algorithm.adv_estimatr'"):
        load_config("examples/arith.yaml", ["algorithm.adv_estimatr=grpoo"])


def test_reward_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="reward.function: file not found"):
        load_config("examples/arith.yaml", [f"reward.function={tmp_path}/nope.py:score"])
    f = tmp_path / "mine.py"
    f.write_text("def score(response, answer):\n    return 1.0\n")
    assert load_config("examples/arith.yaml", [f"reward.function={f}:score"]).reward.function.endswith("mine.py:score")


@pytest.mark.parametrize("overrides,critic,baseline,reference", [
    ([], False, False, False),
    (["algorithm.adv_estimator=gae"], True, False, False),
    (["algorithm.adv_estimator=remax"], False, True, False),
    (["algorithm.use_kl_loss=true"], False, False, True),
    (["algorithm.kl_in_reward.enable=true"], False, False, True),
])
def test_algorithm_needs_come_from_the_estimator_declaration(overrides, critic, baseline, reference):
    needs = algorithm_needs(load_config("examples/arith.yaml", overrides))
    assert (needs.critic, needs.baseline, needs.reference) == (critic, baseline, reference)
