"""The old-log-prob pass folded into the update (``algorithm.fold_old_logprob``): one optimizer
step on fresh samples takes its behaviour log-probs from its own forward."""

import copy

import pytest
import torch

from fitrl.algo.mismatch import mismatch_metrics
from fitrl.config import load_config
from fitrl.config.schema import ActorConfig, AlgorithmConfig, RolloutCorrectionConfig
from fitrl.roles.actor import Actor
from helpers import EXAMPLE, read_metrics, tiny_rollout
from helpers import toy_config as config


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, batch = tiny_rollout(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    mask = batch["response_mask"].float()
    batch.update(advantages=torch.randn(8, 1, generator=g) * mask)
    return model, batch


def update(model, batch, *, micro=8, mode="off", shuffle=True, old_logprobs_from="update"):
    """(grads after one update, its metrics); the optimizer step is taken with lr 0."""
    model = copy.deepcopy(model)
    algo = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(mode=mode, cap=1.05))
    cfg = ActorConfig(micro_batch_size=micro, shuffle_mini_batches=shuffle)
    cfg.optim.lr = 0.0
    actor = Actor(model, cfg, algo, total_steps=1, max_response_length=6)
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
             for n, p in model.named_parameters()]
    metrics = actor.update(batch, sequences_per_mini_batch=len(batch), temperature=1.0,
                           old_logprobs_from=old_logprobs_from)
    for h in hooks:
        h.remove()
    return grads, metrics, actor


@pytest.mark.parametrize("mode", ["off", "token", "sequence"])
def test_folded_update_equals_the_separate_pass(setup, mode):
    model, batch = setup
    _, _, actor = update(model, batch)
    passed = actor.compute_logprob(batch, temperature=1.0)["old_logprobs"]  # the pass the fold skips
    with_pass = batch.index(list(range(len(batch)))).update(old_logprobs=passed)
    g_fold, m_fold, _ = update(model, batch, mode=mode)
    g_pass, m_pass, _ = update(model, with_pass, mode=mode, old_logprobs_from="batch")
    for name in g_pass:
        torch.testing.assert_close(g_fold[name], g_pass[name], rtol=1e-5, atol=1e-7)
    assert m_fold["actor/clip_frac"] == 0.0  # ratio exactly 1
    # the mismatch metrics the driver logs after a pass, now from the update's forward
    expected = mismatch_metrics(passed, batch["rollout_logprobs"], batch["response_mask"].float(),
                                level=None if mode == "off" else mode, cap=1.05)
    for key, value in expected.items():
        assert m_fold[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_folded_update_is_micro_batch_invariant(setup):
    model, batch = setup
    g8, m8, _ = update(model, batch, micro=8)
    g2, m2, _ = update(model, batch, micro=2)
    for name in g8:
        torch.testing.assert_close(g2[name], g8[name], rtol=1e-4, atol=1e-6)
    assert m2["rollout/logprob_diff_max"] == pytest.approx(m8["rollout/logprob_diff_max"], abs=1e-5)


def test_more_than_one_optimizer_step_needs_old_logprobs(setup):
    model, batch = setup
    actor = Actor(copy.deepcopy(model), ActorConfig(micro_batch_size=4), AlgorithmConfig(), total_steps=1)
    with pytest.raises(RuntimeError, match="old_logprobs"):
        actor.update(batch, sequences_per_mini_batch=4, temperature=1.0, old_logprobs_from="update")
    with pytest.raises(RuntimeError, match="old_logprobs come from 'batch', and the batch has none"):
        actor.update(batch, sequences_per_mini_batch=4, temperature=1.0)


@pytest.mark.parametrize("overrides,source", [
    (["actor.mini_batch_size=8"], "update"),
    (["actor.mini_batch_size=4"], "pass"),  # two optimizer steps: the second is off-policy
    (["actor.mini_batch_size=8", "actor.ppo_epochs=2"], "pass"),
    (["actor.mini_batch_size=8", "algorithm.fold_old_logprob=false"], "pass"),
    (["actor.mini_batch_size=8", "algorithm.kl_in_reward.enable=true"], "pass"),  # needed before the update
    (["actor.mini_batch_size=8", "algorithm.recompute_old_logprob=false"], "rollout"),
])
def test_old_logprob_source(overrides, source):
    assert load_config(EXAMPLE, overrides).old_logprob_source == source


@pytest.mark.slow
def test_training_skips_the_pass(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(config(tiny_model_dir, run_dir, "trainer.max_steps=2", "actor.mini_batch_size=8",
                 "trainer.val_before_train=false", "data.val_files=[]"))
    steps = read_metrics(run_dir)
    assert len(steps) == 2
    for r in steps:
        assert "time/old_logprob" not in r and "time/update" in r
        assert r["actor/clip_frac"] == 0.0
        assert r["rollout/logprob_diff_max"] < 1e-3  # the HF engine and the update see the same weights
