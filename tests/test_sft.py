"""``fitrl sft`` (fitrl/trainer/sft.py): the loss is the targets' negative log-likelihood, a run
learns the answers, resumes exactly, exports to a directory ``fitrl train`` starts from, and bad
input is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import read_metrics, toy_config

VOLATILE = ("time/", "mem/", "val/time", "perf/")
SFT = ["trainer.val_freq=0", "trainer.val_before_train=false", "checkpoint.save_freq=3", "actor.optim.lr=3e-3"]


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def test_the_supervised_loss_is_the_targets_negative_log_likelihood(tiny_model_dir):
    """By hand: log-softmax of the model's logits at the target positions, token-mean."""
    from fitrl.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, ModelConfig
    from fitrl.core.padding import position_ids_from_mask
    from fitrl.data.batch import Batch
    from fitrl.data.supervised import supervised_batch, target_ids
    from fitrl.models.loading import build_model, load_tokenizer
    from fitrl.roles.actor import Actor

    mcfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(mcfg)
    model = build_model("causal_lm", mcfg, FSDPConfig(), torch.device("cpu"))
    prompts = Batch(fields={"prompt_ids": [tok("What is 1 + 2?")["input_ids"], tok("3 + 4 =")["input_ids"]],
                            "answer": [3, "seven"]})
    targets = target_ids(prompts["answer"], tok, tok.eos_token_id, max_length=8)
    assert targets[0] == tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    batch = supervised_batch(prompts, targets, pad_id=tok.pad_token_id)
    batch.update(position_ids=position_ids_from_mask(batch["attention_mask"]))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()
    R = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].float()
    by_hand = float(-(logp * mask).sum() / mask.sum())

    actor = Actor(model, ActorConfig(micro_batch_size=1), AlgorithmConfig(), total_steps=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = actor.update(batch, sequences_per_mini_batch=2, temperature=0.7, supervised=True)  # (temperature: unused)
    assert m["sft/nll"] == pytest.approx(by_hand, rel=1e-5)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.slow
def test_sft_learns_resumes_exactly_and_its_export_starts_rl(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    whole = train(toy_config(tiny_model_dir, tmp_path / "whole", "trainer.max_steps=12", *SFT), supervised=True)
    nll = [h["sft/nll"] for h in whole]
    assert sum(nll[-3:]) / 3 < 0.5 * sum(nll[:3]) / 3  # the answers are learned
    assert "reward/mean" not in whole[-1] and whole[-1]["actor/grad_norm"] > 0

    # killed after step 7 (the step-6 checkpoint is the newest), resumed: the same 12 steps
    part = tmp_path / "part"
    train(toy_config(tiny_model_dir, part, "trainer.max_steps=7", "checkpoint.save_final=false", *SFT),
          supervised=True)
    train(toy_config(tiny_model_dir, part, "trainer.max_steps=12", *SFT), supervised=True)
    assert comparable(read_metrics(part)) == comparable(read_metrics(tmp_path / "whole"))

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "export", str(tmp_path / "whole"), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rl = train(toy_config(out, tmp_path / "rl", "trainer.max_steps=2", "trainer.val_freq=0"))
    assert len(rl) == 2 and "reward/mean" in rl[-1]


@pytest.mark.cli
def test_sft_bad_input_is_one_line_exit_2(tiny_model_dir, tmp_path):
    from helpers import DATA, EXAMPLE

    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "sft", str(EXAMPLE), f"actor.model.path={tiny_model_dir}",
                           f"trainer.run_dir={tmp_path}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]",
                           "data.answer_key=solution", "memory.plan=off"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "row has no 'solution' column" in proc.stderr and "Traceback" not in proc.stderr


def _prompts(worker, n: int = 4):
    from fitrl.data.batch import Batch

    tok = worker.tokenizer
    texts = [f"What is {a} + {b}?" for a, b in [(1, 2), (7, 5), (0, 0), (4, 4)][:n]]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    return Batch(fields={"prompt_ids": ids, "answer": [3, 12, 0, 8][:n]})


def test_lora_sft_trains_only_the_adapters(tiny_model_dir, tmp_path):
    from fitrl.roles.workers import PolicyWorker

    worker = PolicyWorker(toy_config(tiny_model_dir, tmp_path, "actor.lora.rank=4", "actor.optim.lr=1e-2",
                                     "data.rollout_batch_size=4", "actor.mini_batch_size=4"), rank=0, world_size=1)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    metrics = worker.sft_update(_prompts(worker))
    changed = [n for n, p in worker.model.named_parameters() if not torch.equal(before[n], p)]
    assert metrics["sft/nll"] > 0 and changed and all(".lora_" in n for n in changed)


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(ray_cluster, tiny_model_dir, tmp_path):
    """A supervised step on 2 FSDP2 ranks (gloo) is the one-process step, to one AdamW step's rounding."""
    from fitrl.roles.workers import PolicyWorker
    from fitrl.workers.group import RoleHandle
    from fitrl.workers.ray_group import RayWorkerGroup
    from helpers import FP32_UNIT_ROUNDOFF, assert_same_adam_step

    batch_keys = ["data.rollout_batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=1",
                  "trainer.device=cpu", "actor.optim.lr=1e-4", "actor.optim.warmup_steps=0"]
    one = PolicyWorker(toy_config(tiny_model_dir, tmp_path / "one", *batch_keys), rank=0, world_size=1)
    prompts = _prompts(one)
    before = one.state_dict()
    ref = one.sft_update(prompts)
    cfg = toy_config(tiny_model_dir, tmp_path / "two", *batch_keys, "trainer.backend=ray", "trainer.devices_per_node=2")
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy") as group:
        policy = RoleHandle(group)
        metrics = policy.sft_update(prompts)  # each rank gets 2 of the 4 prompts
        state = policy.state_dict()
    assert metrics["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-5)
    terms = len(prompts) * (max(map(len, prompts["prompt_ids"])) + 3)  # the input_ids: targets of <= 2 digits + end
    assert_same_adam_step(state, one.state_dict(), before, lr=1e-4, eps=1e-8, grad_norm=ref["actor/grad_norm"],
                          terms=terms, unit_roundoff=FP32_UNIT_ROUNDOFF, label="sft 2 ranks")


@pytest.mark.slow
def test_the_demo_warm_starts_then_judges_validation_accuracy(tiny_model_dir, tmp_path):
    """``fitrl demo``: supervised steps, their export, GRPO from it, and the accuracy line read
    from the GRPO run's first and last validations (shortened: the figures are docs/sft.md's)."""
    import json

    from helpers import ROOT

    run = tmp_path / "grpo"
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "demo", "--warm-start-steps", "6",
                           f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={run}", "trainer.max_steps=3",
                           "trainer.val_freq=0", "trainer.progress_bar=false"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "warm start: 6 supervised steps" in proc.stdout
    hf = Path(f"{run}-sft") / "hf"
    assert (hf / "config.json").is_file()
    import yaml
    assert yaml.safe_load((run / "config.yaml").read_text())["actor"]["model"]["path"] == str(hf)
    vals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val/reward/exact" in r]
    before, after = vals[0]["val/reward/exact"], vals[-1]["val/reward/exact"]
    assert f"validation exact-match accuracy: {before:.3f} at step 0, {after:.3f} at step 3" in proc.stdout
    assert proc.returncode == (0 if after > before else 1)
