"""Every advantage estimator and the DAPO / KL / overlong options run end to end on the toy task."""

import math

import pytest

from fitrl.core.errors import RunStopped
from fitrl.trainer.run import train
from helpers import read_metrics, toy_config

pytestmark = pytest.mark.slow  # multi-step runs or worker processes: not in the fast tier

SMALL = ["trainer.max_steps=3", "trainer.val_before_train=false", "data.val_files=[]", "data.rollout_batch_size=4",
         "rollout.n=4", "actor.mini_batch_size=2", "actor.micro_batch_size=4", "critic.mini_batch_size=4",
         "critic.micro_batch_size=8"]

ESTIMATORS = {
    "grpo": [],
    "drgrpo": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": [],
    "reinforce_plus_plus": ["algorithm.kl_in_reward.enable=true", "algorithm.gamma=0.99"],
    "reinforce_plus_plus_baseline": [],
    "remax": [],
    "gae": ["algorithm.lam=0.95", "critic.warmup_steps=1", "critic.optim.lr=1e-3"],
}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_estimator_runs_end_to_end(estimator, tiny_model_dir, tmp_path):
    run_dir = tmp_path / estimator
    train(toy_config(tiny_model_dir, run_dir, *SMALL, f"algorithm.adv_estimator={estimator}",
                     *ESTIMATORS[estimator]))
    steps = read_metrics(run_dir)
    assert len(steps) == 3
    for m in steps:
        assert math.isfinite(m["advantage/mean"]) and math.isfinite(m["reward/mean"])
    if estimator == "gae":
        assert all("critic/vf_loss" in m and "time/values" in m for m in steps)
        assert "actor/pg_loss" not in steps[0]  # critic warm-up: the actor waits one step
        assert "actor/pg_loss" in steps[1]
    else:
        assert all("actor/pg_loss" in m for m in steps)
    if estimator == "remax":
        assert all("time/baseline_rollout" in m for m in steps)
    if estimator == "reinforce_plus_plus":
        assert all("kl_in_reward/kl" in m and "time/ref" in m for m in steps)


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_policy_losses_run(loss, tiny_model_dir, tmp_path):
    extra = ["actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4",
             "algorithm.loss_agg_mode=seq-mean-token-mean"] if loss == "gspo" else []
    train(toy_config(tiny_model_dir, tmp_path, *SMALL, f"algorithm.policy_loss={loss}", *extra))
    assert all(math.isfinite(m["actor/pg_loss"]) for m in read_metrics(tmp_path))


@pytest.fixture
def parity_reward(tmp_path):
    """Deterministic per prompt when the answer is < 10 (an all-equal group), varied otherwise."""
    f = tmp_path / "parity.py"
    f.write_text("def reward(response, answer):\n"
                 "    if int(answer) < 10:\n        return 1.0\n"
                 "    return float(sum(map(ord, response)) % 2)\n")
    return f"{f}:reward"


def test_dynamic_sampling_fills_the_batch(tiny_model_dir, tmp_path, parity_reward):
    run_dir = tmp_path / "run"
    train(toy_config(tiny_model_dir, run_dir, *SMALL, f"reward.function={parity_reward}",
                     "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=20"))
    steps = read_metrics(run_dir)
    assert sum(m["sampling/groups_dropped"] for m in steps) > 0
    assert all(m["sampling/groups_kept"] == 4 for m in steps)  # full batch every step
    assert any(m["sampling/rounds"] > 1 for m in steps)


def test_dynamic_sampling_exhausted_continue_or_stop(tiny_model_dir, tmp_path, parity_reward):
    run_dir = tmp_path / "partial"
    train(toy_config(tiny_model_dir, run_dir, *SMALL, "trainer.max_steps=2", f"reward.function={parity_reward}",
                     "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                     "data.rollout_batch_size=8", "actor.mini_batch_size=8", "actor.micro_batch_size=8",
                     "critic.mini_batch_size=8"))
    steps = read_metrics(run_dir)
    assert all(m["sampling/rounds"] == 1 and m["sampling/groups_kept"] < 8 for m in steps)
    with pytest.raises(RunStopped, match="max_num_gen_batches=1"):
        train(toy_config(tiny_model_dir, tmp_path / "stop", *SMALL, f"reward.function={parity_reward}",
                         "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                         "algorithm.filter_groups.on_exhausted=stop", "data.rollout_batch_size=8",
                         "actor.mini_batch_size=8", "actor.micro_batch_size=8", "critic.mini_batch_size=8"))


def test_filter_on_unknown_component_says_which_exist(tiny_model_dir, tmp_path):
    with pytest.raises(RunStopped, match="components: score, digits, closeness, exact"):
        train(toy_config(tiny_model_dir, tmp_path, *SMALL, "algorithm.filter_groups.enable=true",
                         "algorithm.filter_groups.metric=exactt"))


def test_adaptive_kl_in_reward_and_overlong(tiny_model_dir, tmp_path):
    train(toy_config(tiny_model_dir, tmp_path, *SMALL, "algorithm.kl_in_reward.enable=true",
                     "algorithm.kl_in_reward.controller=adaptive", "algorithm.kl_in_reward.horizon=100",
                     "algorithm.overlong.enable=true", "algorithm.overlong.buffer_length=4"))
    steps = read_metrics(tmp_path)
    coefs = [m["kl_in_reward/coef"] for m in steps]
    # step 1: policy == reference, KL 0 < target: the controller lowers the coefficient
    assert coefs[1] < coefs[0]


def test_dynamic_sampling_with_no_informative_group_continues_with_zero_gradient(tiny_model_dir, tmp_path):
    f = tmp_path / "const.py"
    f.write_text("def reward(response, answer):\n    return 0.5\n")
    train(toy_config(tiny_model_dir, tmp_path / "run", *SMALL, "trainer.max_steps=1", f"reward.function={f}:reward",
                     "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"))
    (m,) = read_metrics(tmp_path / "run")
    assert m["sampling/groups_kept"] == 0 and m["sampling/rounds"] == 2
    assert m["advantage/max"] == 0 and m["advantage/min"] == 0
