"""Mixed precision in one process: ``actor.fsdp.mixed_precision`` runs every forward of the
policy (generation, log-probs, the update's) under bf16 autocast on its fp32 weights."""

import copy

import pytest
import torch

from fitrl.config import load_config
from fitrl.config.schema import ActorConfig, AlgorithmConfig
from fitrl.ops.logprob import head_logprobs
from fitrl.roles.actor import Actor
from helpers import EXAMPLE, read_metrics, tiny_rollout
from helpers import toy_config as config


def test_head_logprobs_under_autocast_match_an_explicit_bf16_head():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = head_logprobs(hidden, labels, weight, chunk_size=4)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and weight.grad.dtype == torch.float32  # fp32 master weight
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = torch.log_softmax((h2.bfloat16() @ w2.bfloat16().T).float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    ref.sum().backward()
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=2e-2, atol=2e-2)  # bf16 products
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=2e-2, atol=2e-2)


def test_update_under_autocast_is_close_to_fp32_and_keeps_fp32_weights(tiny_model_dir):
    model, batch = tiny_rollout(tiny_model_dir)
    mask = batch["response_mask"].float()
    batch.update(advantages=torch.randn(8, 1, generator=torch.Generator().manual_seed(2)) * mask)
    grads = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        m = copy.deepcopy(model)
        actor = Actor(m, ActorConfig(micro_batch_size=4), AlgorithmConfig(), total_steps=1, max_response_length=6,
                      autocast_dtype=dtype)
        actor.model.train()
        from fitrl.roles.actor import WeightedMetrics
        actor.accumulate_gradients(batch.index(list(range(8))).update(old_logprobs=batch["rollout_logprobs"]),
                                   temperature=1.0, metrics=WeightedMetrics())
        grads[name] = torch.cat([p.grad.flatten() for p in m.parameters()])
        assert all(p.dtype == torch.float32 for p in m.parameters())
    cos = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cos > 0.99, float(cos)
    assert not torch.equal(grads["fp32"], grads["bf16"])  # bf16 compute did happen


def test_mixed_precision_in_one_process_is_accepted_but_not_for_the_critic():
    assert load_config(EXAMPLE, ["actor.fsdp.mixed_precision=true"]).autocast_dtype("actor") == "bfloat16"
    assert load_config(EXAMPLE, []).autocast_dtype("actor") is None
    assert load_config(EXAMPLE, ["actor.fsdp.mixed_precision=true", "trainer.backend=ray",
                                 "trainer.devices_per_node=2", "actor.micro_batch_size=16"]).autocast_dtype("actor") is None  # FSDP2's
    with pytest.raises(Exception, match="critic.fsdp"):
        load_config(EXAMPLE, ["critic.fsdp.mixed_precision=true"])


@pytest.mark.slow
def test_training_in_bf16_autocast(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(config(tiny_model_dir, run_dir, "trainer.max_steps=3", "actor.fsdp.mixed_precision=true",
                 "trainer.val_before_train=false", "data.val_files=[]", "actor.mini_batch_size=8"))
    steps = read_metrics(run_dir)
    assert len(steps) == 3
    for r in steps:
        assert r["actor/grad_norm"] > 0 and r["actor/weights_nonfinite"] == 0
        # generation and the update both compute in bf16: close, not equal
        assert 0 < r["rollout/logprob_diff_mean"] < 0.05, r["rollout/logprob_diff_mean"]
