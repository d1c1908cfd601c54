"""LoRA on the policy: only adapters train, the frozen base is the reference, GRPO with LoRA
raises the reward, and 2 FSDP2 ranks compute what one process computes."""

from __future__ import annotations

import shutil

import pytest
import torch

from fitrl.trainer.verdict import judge_rise
from fitrl.config.schema import SamplingConfig
from fitrl.core.errors import ConfigError
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.workers.group import RoleHandle
from helpers import assert_same_adam_step, read_metrics, toy_config

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16"]
BATCH = ["data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", "actor.optim.lr=1e-3", "actor.optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def lora_base_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its (tied) embedding and output head scaled x8: a random-initialised
    head has logits of std ~0.2, so a policy whose head and final norm are frozen cannot become
    confident whatever its adapters do (measured: log p of one target token stops at -4.8 with
    LoRA, reaches -0.02 with full fine-tuning). A trained model's head has that scale already."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("models") / "tiny-qwen2-head-x8"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    return out


def prompts(worker: PolicyWorker) -> Batch:
    tok = worker.tokenizer
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number.", "Hi", "What is 0 + 0?"]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(fields={"prompt_ids": ids})


def one_update(worker: PolicyWorker) -> tuple[Batch, dict]:
    torch.manual_seed(0)
    batch = worker.generate(prompts(worker), SamplingConfig(n=2, max_tokens=6))
    batch.update(worker.compute_logprob(batch))
    g = torch.Generator().manual_seed(1)
    batch.update(advantages=torch.randn(len(batch), 1, generator=g) * batch["response_mask"])
    return batch, worker.update(batch)


def test_only_adapters_train_and_the_frozen_base_is_the_reference(tiny_model_dir, tmp_path):
    worker = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *BATCH, *LORA), rank=0, world_size=1)
    trained = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    optimized = sum(p.numel() for g in worker.actor.optimizer.param_groups for p in g["params"])
    assert optimized == sum(p.numel() for n, p in worker.model.named_parameters() if n in trained)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}

    batch, _ = one_update(worker)
    # rollout and training forward agree on the adapted weights (same module, same kernels)
    mask = batch["response_mask"].bool()
    assert (batch["old_logprobs"] - batch["rollout_logprobs"])[mask].abs().max() < 1e-5
    # B starts at zero: before the update the adapted policy is the base, so ref == old log-probs
    ref = worker.compute_ref_logprob(batch)["ref_logprobs"]
    assert (ref - batch["old_logprobs"])[mask].abs().max() < 1e-5
    after_ref = worker.compute_ref_logprob(batch)["ref_logprobs"]
    now = worker.compute_logprob(batch)["old_logprobs"]
    assert torch.equal(after_ref, ref)                                # the base did not move ...
    assert (now - batch["old_logprobs"])[mask].abs().max() > 1e-4     # ... the adapters did
    changed = {n for n, p in worker.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trained


def test_adapter_on_the_output_head_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="output head"):
        PolicyWorker(toy_config(tiny_model_dir, tmp_path, "actor.lora.rank=4", "actor.lora.target_modules=[q_proj,lm_head]"),
                     rank=0, world_size=1)
    with pytest.raises(ConfigError, match="actor.lora.target_modules=\\['nope'\\]"):
        PolicyWorker(toy_config(tiny_model_dir, tmp_path, "actor.lora.rank=4", "actor.lora.target_modules=[nope]"),
                     rank=0, world_size=1)


@pytest.mark.slow
def test_grpo_with_lora_raises_the_reward(lora_base_dir, tmp_path):
    from fitrl.trainer.run import train

    history = train(toy_config(lora_base_dir, tmp_path, "actor.lora.rank=16", "actor.lora.alpha=32",
                               "actor.optim.lr=5e-3", "algorithm.use_kl_loss=true", "algorithm.kl_coef=1e-3",
                               "trainer.val_freq=0", "checkpoint.save_final=false"))
    verdict = judge_rise([h["reward/mean"] for h in history])
    assert verdict["rose"], verdict["message"]
    steps = [m for m in read_metrics(tmp_path) if "actor/grad_norm" in m]
    assert max(m["rollout/logprob_diff_mean"] for m in steps) < 1e-5
    assert all("time/ref" in m for m in steps)  # the reference phase ran, on the policy's frozen base


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(ray_cluster, tiny_model_dir, tmp_path):
    from fitrl.workers.ray_group import RayWorkerGroup

    local = PolicyWorker(toy_config(tiny_model_dir, tmp_path / "one", *BATCH, *LORA), rank=0, world_size=1)
    before = local.state_dict()
    batch, ref_metrics = one_update(local)
    ref_state = local.state_dict()
    cfg = toy_config(tiny_model_dir, tmp_path / "two", *BATCH, *LORA, "trainer.backend=ray",
                     "trainer.devices_per_node=2")
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy") as group:
        metrics = RoleHandle(group).update(batch)  # each rank gets 4 of the 8 sequences
        state = RoleHandle(group).state_dict()
    # the adapters' gradient (its global norm) and the weights after one step are the same
    assert metrics["actor/grad_norm"] == pytest.approx(ref_metrics["actor/grad_norm"], rel=1e-5)
    assert any(".lora_" in k for k in ref_state)
    # within what rounding allows for one AdamW step (tests/helpers.py, adam_step_tolerance): the two
    # ranks sum the batch's tokens in another order; Adam turns that into up to a whole step where a
    # gradient nearly cancels, and into almost nothing elsewhere
    assert_same_adam_step(state, ref_state, before, lr=1e-3, eps=1e-8, grad_norm=ref_metrics["actor/grad_norm"],
                          terms=batch["input_ids"].numel(), label="two ranks")
