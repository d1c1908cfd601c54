"""Rollout vs trainer log-probs (fitrl/algo/mismatch.py): mismatch metrics and truncated importance
sampling on hand-written tensors, its config, and the actor's loss with the correction on."""

import copy
import math

import pytest
import torch

from fitrl.algo.mismatch import mismatch_metrics, truncated_is_weights
from fitrl.config import load_config
from fitrl.config.schema import (ActorConfig, AlgorithmConfig, ConfigError, RolloutCorrectionConfig)
from fitrl.roles.actor import Actor, WeightedMetrics
from helpers import tiny_rollout

# 2 sequences x 3 tokens; the second's last position is padding holding a value far off (-9 vs 0)
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
D = [0.5, -1.0, 0.0, 0.0, -0.2]  # trainer - rollout on the 5 real tokens


def k3(d):
    return math.exp(d) - 1 - d


def test_metrics_by_hand():
    m = mismatch_metrics(TRAINER, ROLLOUT, MASK)
    assert set(m) == {"rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/kl", "rollout/ppl_ratio"}
    assert m["rollout/logprob_diff_mean"] == pytest.approx(sum(abs(d) for d in D) / 5)  # 0.34
    assert m["rollout/logprob_diff_max"] == pytest.approx(1.0)
    assert m["rollout/kl"] == pytest.approx(sum(k3(d) for d in D) / 5)
    assert m["rollout/ppl_ratio"] == pytest.approx(math.exp(-sum(D) / 5))  # exp(0.14): the engine is sharper


def test_kl_of_close_engines_is_not_rounded_away():
    """d = 1e-3 (float32 inputs): k3 ~ d^2 / 2 = 5e-7, below float32's resolution of exp(d)."""
    trainer = torch.full((1, 4), -1.0)
    m = mismatch_metrics(trainer, trainer - 1e-3, torch.ones(1, 4))
    d = float((trainer - (trainer - 1e-3))[0, 0])  # the float32 difference itself
    assert m["rollout/kl"] == pytest.approx(k3(d), rel=1e-6)


def test_token_weights_by_hand():
    w = truncated_is_weights(TRAINER, ROLLOUT, MASK, "token", cap=1.5)
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0], [1.0, math.exp(-0.2), 0.0]])  # exp(0.5) = 1.65 capped
    assert torch.allclose(w, expected)
    m = mismatch_metrics(TRAINER, ROLLOUT, MASK, level="token", cap=1.5)
    assert m["rollout/is_weight_mean"] == pytest.approx(float(expected.sum()) / 5)
    assert m["rollout/is_clipped_frac"] == pytest.approx(1 / 5)


def test_sequence_weights_by_hand():
    w = truncated_is_weights(TRAINER, ROLLOUT, MASK, "sequence", cap=0.7)
    # row 0: exp(0.5 - 1 + 0) = 0.607 under the cap; row 1: exp(-0.2) = 0.819 capped at 0.7
    expected = torch.tensor([[math.exp(-0.5)] * 3, [0.7, 0.7, 0.0]])
    assert torch.allclose(w, expected)
    m = mismatch_metrics(TRAINER, ROLLOUT, MASK, level="sequence", cap=0.7)
    assert m["rollout/is_weight_mean"] == pytest.approx((3 * math.exp(-0.5) + 2 * 0.7) / 5)
    assert m["rollout/is_clipped_frac"] == pytest.approx(2 / 5)  # the 2 tokens of the capped sequence
    # a cap above every weight leaves them exact
    assert torch.allclose(truncated_is_weights(TRAINER, ROLLOUT, MASK, "sequence", cap=10.0),
                          torch.tensor([[math.exp(-0.5)] * 3, [math.exp(-0.2)] * 2 + [0.0]]))


def test_weights_are_detached():
    t = TRAINER.clone().requires_grad_(True)
    for level in ("token", "sequence"):
        assert not truncated_is_weights(t, ROLLOUT, MASK, level, cap=2.0).requires_grad
    with pytest.raises(ValueError, match="token"):
        truncated_is_weights(TRAINER, ROLLOUT, MASK, "tokens", cap=2.0)


@pytest.mark.parametrize("shape", [(2, 3), (0, 3)])
def test_empty_mask_gives_no_nan(shape):
    zeros = torch.zeros(shape)
    m = mismatch_metrics(torch.full(shape, -1.0), torch.full(shape, -3.0), zeros, level="sequence", cap=2.0)
    assert m == {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0, "rollout/kl": 0.0,
                 "rollout/ppl_ratio": 1.0, "rollout/is_weight_mean": 0.0, "rollout/is_clipped_frac": 0.0}
    for level in ("token", "sequence"):
        assert torch.equal(truncated_is_weights(torch.zeros(shape), zeros, zeros, level, cap=2.0), zeros)


def test_large_log_differences_give_the_cap_not_inf():
    trainer = torch.tensor([[0.0, 0.0, 0.0], [0.0, -1000.0, 0.0]])
    rollout = torch.tensor([[-1000.0, -60.0, -60.0], [0.0, 0.0, -float("inf")]])  # row 0 sums to 1120 >> log(max fp32)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # -inf on padding must not leak a NaN
    token = truncated_is_weights(trainer, rollout, mask, "token", cap=3.0)
    assert torch.equal(token, torch.tensor([[3.0, 3.0, 3.0], [1.0, 0.0, 0.0]]))  # exp(-1000) underflows to 0
    seq = truncated_is_weights(trainer, rollout, mask, "sequence", cap=3.0)
    assert torch.equal(seq, torch.tensor([[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]]))
    for level in ("token", "sequence"):
        m = mismatch_metrics(trainer, rollout, mask, level=level, cap=3.0)
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["rollout/logprob_diff_max"] == 1000.0


# ------------------------------------------------------------------------------------ config


def test_config_defaults_and_overrides():
    assert load_config(None).algorithm.rollout_correction == RolloutCorrectionConfig(mode="off", cap=2.0)
    rc = load_config(None, ["algorithm.rollout_correction.mode=sequence",
                            "algorithm.rollout_correction.cap=3"]).algorithm.rollout_correction
    assert (rc.mode, rc.cap) == ("sequence", 3.0)
    assert load_config(None, ["algorithm.rollout_correction.mode=off"]).algorithm.rollout_correction.mode == "off"


@pytest.mark.parametrize("cap", ["0", "-1", ".inf", ".nan"])  # the loader itself refuses non-finite floats
def test_cap_must_be_finite_and_positive(cap):
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.cap'? .*must be a finite number"):
        load_config(None, [f"algorithm.rollout_correction.cap={cap}"])
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction\.cap must be a finite number > 0"):
        RolloutCorrectionConfig(cap=float(cap.replace(".inf", "inf").replace(".nan", "nan")))


def test_correction_needs_the_trainers_logprobs():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.rollout_correction.mode=token", "algorithm.recompute_old_logprob=false"])
    assert "algorithm.rollout_correction.mode=token" in str(err.value)
    assert "algorithm.recompute_old_logprob=true" in str(err.value)
    # off with the rollout's log-probs stays valid
    load_config(None, ["algorithm.recompute_old_logprob=false"])


# ------------------------------------------------------------------------------------ actor


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, batch = tiny_rollout(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    # the trainer's recomputation, off the engine's by up to ~0.3 nats per token: some weights pass the cap
    batch.update(old_logprobs=batch["rollout_logprobs"] + 0.15 * torch.randn(mask.shape, generator=g) * mask,
                 advantages=torch.randn(8, 1, generator=g) * mask)
    return model, batch


def grads(model, batch, mode="off", cap=1.1, micro=8, policy_loss="ppo_clip"):
    model = copy.deepcopy(model)
    algo = AlgorithmConfig(policy_loss=policy_loss, rollout_correction=RolloutCorrectionConfig(mode=mode, cap=cap))
    actor = Actor(model, ActorConfig(micro_batch_size=micro), algo, total_steps=1, max_response_length=6)
    actor.model.train()
    actor.accumulate_gradients(batch, temperature=1.0, metrics=WeightedMetrics())
    return [p.grad.clone() for p in model.parameters()]


def with_columns(batch, **tensors):
    return batch.index(list(range(len(batch)))).update(**tensors)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_agreeing_engines_change_nothing(setup, mode):
    """Rollout log-probs equal to the trainer's: every weight is 1, the gradient is mode off's."""
    model, batch = setup
    same = with_columns(batch, rollout_logprobs=batch["old_logprobs"].clone())
    for g, r in zip(grads(model, same, mode), grads(model, same, "off")):
        assert torch.equal(g, r)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "cispo"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_gradient_equals_the_hand_weighted_one(setup, mode, policy_loss):
    """The correction's gradient is mode off's on advantages weighted by hand, and it does not
    depend on the micro-batch size."""
    model, batch = setup
    mask = batch["response_mask"].float()
    d = (batch["old_logprobs"] - batch["rollout_logprobs"]) * mask  # (B, R)
    log_w = d if mode == "token" else d.sum(-1, keepdim=True).expand_as(d)
    w = torch.minimum(torch.exp(log_w), torch.tensor(1.1)) * mask
    assert 0 < int(((torch.exp(log_w) > 1.1) & (mask > 0)).sum()) < int(mask.sum())  # the cap bites, not everywhere
    weighted = with_columns(batch, advantages=batch["advantages"] * w)
    reference = grads(model, weighted, "off", policy_loss=policy_loss)
    assert any(r.abs().sum() > 0 for r in reference)
    for micro in (8, 2):
        for g, r in zip(grads(model, batch, mode, micro=micro, policy_loss=policy_loss), reference):
            assert torch.allclose(g, r, atol=1e-6, rtol=1e-4), f"micro_batch_size={micro}"
    off = grads(model, batch, "off", policy_loss=policy_loss)
    assert any(not torch.allclose(g, o) for g, o in zip(reference, off))  # the correction does something
