"""Defaults that bend (issue 37): a micro-batch larger than the mini-batch is the mini-batch (said
once at start-up), a group estimator with one sample per prompt is refused in one line, and a
step with no learning signal says so."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fitrl.config import ConfigError, load_config
from fitrl.config.schema import adjustments
from helpers import EXAMPLE, read_metrics, toy_config


def test_a_micro_batch_larger_than_the_mini_batch_is_the_mini_batch():
    cfg = load_config(EXAMPLE, ["rollout.n=4"])  # the example's micro-batch of 32 > 4 prompts x 4 samples
    assert cfg.actor.micro_batch_size == 16
    assert adjustments(cfg) == ["actor.micro_batch_size is larger than a mini-batch's 16 sequences per rank "
                                "(actor.mini_batch_size=4 x rollout.n=4): using 16"]
    ray = load_config(EXAMPLE, ["trainer.backend=ray", "trainer.devices_per_node=2"])
    assert ray.actor.micro_batch_size == 16 and "/ 2 ranks" in adjustments(ray)[0]
    assert adjustments(load_config(EXAMPLE, ["actor.micro_batch_size=8"])) == []  # fits: nothing said
    with pytest.raises(ConfigError, match="not a multiple of actor.micro_batch_size=12"):  # a real mismatch still is
        load_config(EXAMPLE, ["actor.micro_batch_size=12"])


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(estimator):
    with pytest.raises(ConfigError, match=f"adv_estimator={estimator} compares the samples of each prompt, but "
                                          "rollout.n=1"):
        load_config(EXAMPLE, [f"algorithm.adv_estimator={estimator}", "rollout.n=1"])


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "remax"])
def test_estimators_without_groups_take_one_sample(estimator):
    assert load_config(EXAMPLE, [f"algorithm.adv_estimator={estimator}", "rollout.n=1"]).rollout.n == 1


def test_a_step_without_learning_signal_says_so(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    reward = tmp_path / "same.py"
    reward.write_text("def same(response, answer):\n    return 1.0\n")
    out = io.StringIO()
    train(toy_config(tiny_model_dir, tmp_path / "run", "trainer.max_steps=1", "data.val_files=[]", "rollout.n=4",
                     f"reward.function={reward}:same", "checkpoint.save_final=false"),
          Console(file=out, width=200))
    (step,) = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m]
    assert step["adv/zero_variance_groups"] == 8  # every one of the 8 prompts' groups scored alike
    assert "step 1: no learning signal: every advantage is 0 (8 of 8 groups scored alike)" in out.getvalue()
    assert "note: actor.micro_batch_size is larger than a mini-batch's" in out.getvalue()
