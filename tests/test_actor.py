"""The actor's update: micro-batching invariance, schedule, a real optimisation step."""

import copy

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, ModelConfig, OptimConfig
from fitrl.models.loading import build_model
from fitrl.roles.actor import Actor, WeightedMetrics, lr_factor
from helpers import tiny_rollout


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model, batch = tiny_rollout(tiny_model_dir)
    assert len(batch) == 8
    g = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    batch.update(old_logprobs=batch["rollout_logprobs"] + 0.05 * torch.randn(mask.shape, generator=g) * mask,
                 ref_logprobs=batch["rollout_logprobs"] - 0.1 * mask,
                 advantages=torch.randn(8, 1, generator=g) * mask)
    return model, batch


def grads_with_micro(model, batch, micro, use_kl, agg_mode="token-mean", policy_loss="ppo_clip", budget=0):
    model = copy.deepcopy(model)
    algo = AlgorithmConfig(use_kl_loss=use_kl, kl_coef=0.1, loss_agg_mode=agg_mode, policy_loss=policy_loss)
    actor = Actor(model, ActorConfig(micro_batch_size=micro, entropy_coeff=0.01, micro_batch_token_budget=budget),
                  algo, total_steps=1, max_response_length=6)
    actor.model.train()
    actor.accumulate_gradients(batch, temperature=1.0, metrics=WeightedMetrics())
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("use_kl,policy_loss", [(False, "ppo_clip"), (True, "ppo_clip"), (False, "gspo"),
                                                (False, "cispo")])
def test_micro_batching_gives_the_same_gradient(setup, use_kl, agg_mode, policy_loss):
    """1 micro-batch x 8 sequences, 2 x 4, 4 x 2 and 8 x 1 give the same gradient on a real model."""
    model, batch = setup
    reference = grads_with_micro(model, batch, 8, use_kl, agg_mode, policy_loss)
    assert any(g.abs().sum() > 0 for g in reference)
    for micro in (4, 2, 1):
        for g, r in zip(grads_with_micro(model, batch, micro, use_kl, agg_mode, policy_loss), reference):
            assert torch.allclose(g, r, atol=1e-6, rtol=1e-4), f"micro_batch_size={micro}"


def test_update_moves_weights_and_reports_metrics(setup):
    model, batch = setup
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    actor = Actor(model, ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-3)), AlgorithmConfig(), total_steps=5)
    m = actor.update(batch, sequences_per_mini_batch=4, temperature=1.0)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    for key in ("actor/pg_loss", "actor/entropy", "actor/clip_frac", "actor/grad_norm", "actor/lr", "actor/approx_kl"):
        assert key in m
    assert m["actor/grad_norm"] > 0


def test_update_frees_the_gradients(setup, tiny_model_dir):
    """No gradient outlives an update (4 bytes per parameter through rollout and log-probs), for
    the actor, over two mini-batches, and for the critic; the next update recreates them."""
    from fitrl.config.schema import CriticConfig
    from fitrl.roles.critic import Critic

    model, batch = setup
    model = copy.deepcopy(model)
    actor = Actor(model, ActorConfig(micro_batch_size=2, optim=OptimConfig(lr=1e-3)), AlgorithmConfig(), total_steps=2)
    for _ in range(2):
        m = actor.update(batch, sequences_per_mini_batch=4, temperature=1.0)
        assert m["actor/grad_norm"] > 0 and all(p.grad is None for p in model.parameters())
    value = build_model("value", ModelConfig(path=str(tiny_model_dir)), FSDPConfig(), torch.device("cpu"))
    critic = Critic(value, CriticConfig(micro_batch_size=4), total_steps=1, max_response_length=6)
    batch = batch.index(list(range(len(batch))))
    batch.update(critic.compute_values(batch))
    batch.update(returns=batch["values"] + batch["response_mask"])
    m = critic.update(batch, sequences_per_mini_batch=8)
    assert m["critic/grad_norm"] > 0 and all(p.grad is None for p in value.parameters())


def test_lr_schedule():
    warm = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_factor(s, warm, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cos, 11) == pytest.approx(1.0)
    assert lr_factor(5, cos, 11) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_factor(10, cos, 11) == pytest.approx(0.1)  # the last of 11 steps reaches the floor


def test_weighted_metrics_are_token_weighted():
    w = WeightedMetrics()
    w.add({"a": 1.0}, 0.75)
    w.add({"a": 3.0}, 0.25)
    assert w.result() == {"a": 1.5}


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_same_gradient(setup, agg_mode):
    model, batch = setup
    reference = grads_with_micro(model, batch, 8, True, agg_mode)
    total = int(batch["attention_mask"].sum())
    for budget in (total // 3, total // 5, 1):  # about 3, 5 and 8 (one sequence each) micro-batches
        for g, r in zip(grads_with_micro(model, batch, 8, True, agg_mode, budget=budget), reference):
            assert torch.allclose(g, r, atol=1e-6, rtol=1e-4), f"budget={budget}"


def test_token_budget_logprobs_come_back_in_batch_order(setup):
    model, batch = setup
    fixed = Actor(model, ActorConfig(), AlgorithmConfig(), total_steps=1).compute_logprob(batch, 1.0)
    budget = Actor(model, ActorConfig(micro_batch_token_budget=40), AlgorithmConfig(),
                   total_steps=1).compute_logprob(batch, 1.0)
    assert torch.allclose(fixed["old_logprobs"], budget["old_logprobs"], atol=1e-5)
