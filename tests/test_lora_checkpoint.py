"""LoRA checkpoints: the adapters (and their optimizer state) only, restored exactly, refused by a
run with other actor.lora settings, exported as PEFT's adapter directory or merged into the base;
exact resume after SIGKILL and 2-rank save -> 1-process resume (slow)."""

import fnmatch
import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from fitrl.checkpoint import layout
from fitrl.checkpoint.export import export_checkpoint
from fitrl.checkpoint.layout import CheckpointError
from fitrl.checkpoint.manager import RESUME_SAFE, CheckpointManager
from fitrl.config import ConfigError, config_to_dict
from fitrl.config.schema import SamplingConfig
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.workers.group import InProcessWorkerGroup, RoleHandle
from helpers import read_metrics, toy_config
from test_checkpoint_ray import BATCH, RAY, batches, worst  # noqa: F401 (batches: a fixture used here)
from test_checkpoint_resume import CHILD, COMMON, comparable

pytest.importorskip("peft")

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8"]
CPU = ["trainer.device=cpu", "actor.optim.lr=1e-2", "actor.optim.warmup_steps=0"]


def _update(policy: RoleHandle, ids: torch.Tensor) -> None:
    rollout = policy.generate(Batch(fields={"prompt_ids": ids.tolist()}), SamplingConfig(n=2, max_tokens=6))
    rollout.update(policy.compute_logprob(rollout))
    rollout.update(advantages=torch.randn(len(rollout), 1) * rollout["response_mask"])
    policy.update(rollout)


def _logits(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A LoRA policy after two updates, saved as step 2; its worker, config, logits on a batch."""
    run = tmp_path_factory.mktemp("run")
    cfg = toy_config(tiny_model_dir, run, *CPU, *LORA)
    policy = RoleHandle(InProcessWorkerGroup(PolicyWorker, cfg))
    worker: PolicyWorker = policy.group.workers[0]
    ids = worker.tokenizer([f"What is {i} + {i}?" for i in range(4)], return_tensors="pt", padding=True)
    batch = Batch({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]})
    initial = _logits(worker.model, batch)
    for _ in range(2):
        _update(policy, ids["input_ids"])
    logits = _logits(worker.model, batch)
    assert (logits - initial).abs().max() > 0.05  # the adapters moved the policy: comparisons mean something
    path = CheckpointManager(cfg, run, Console(quiet=True)).save(2, {"actor": policy}, {"step": 2}, {})
    return path, cfg, worker, batch, logits


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(trained, tiny_model_dir, tmp_path):
    from fitrl.checkpoint import sharded

    path, _, worker, _, _ = trained
    point = layout.read(path)
    assert point.adapter_only and point.meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                                         "target_modules": ["all-linear"]}
    assert point.meta["base_model"] == str(tiny_model_dir.resolve())
    keys = list(sharded.read_metadata(path / "actor").state_dict_metadata)
    adapters = worker.params.trained_names(worker.model)
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == adapters
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))
    full = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *CPU), rank=0, world_size=1)
    full.save_checkpoint(str(tmp_path / "full"))
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.distcp"))  # noqa: E731
    assert size(path / "actor") < size(tmp_path / "full") / 2  # with AdamW moments, against weights alone


def test_loading_restores_the_adapters_and_the_optimizer_exactly(trained):
    path, cfg, worker, batch, logits = trained
    fresh = PolicyWorker(cfg, rank=0, world_size=1)
    assert not torch.equal(_logits(fresh.model, batch), logits)
    fresh.load_checkpoint(str(path / "actor"))
    saved, loaded = worker.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(_logits(fresh.model, batch), logits)
    assert fresh.actor.num_updates == worker.actor.num_updates == 2
    moments = lambda w: [s["exp_avg_sq"] for s in w.actor.optimizer.state.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(worker), moments(fresh), strict=True))


def test_lora_and_full_checkpoints_do_not_load_into_each_other(trained, tiny_model_dir, tmp_path):
    path, _, _, _, _ = trained
    full = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *CPU), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=r"lora_A.*\(actor\.lora\.rank=0: full fine-tuning"):
        full.load_checkpoint(str(path / "actor"))
    full.save_checkpoint(str(tmp_path / "full"))
    lora = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *CPU, *LORA), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=r"rank=4: .*lora_A.*\(actor\.lora\.rank=4: a LoRA policy"):
        lora.load_checkpoint(str(tmp_path / "full"))
    other_rank = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *CPU, "actor.lora.rank=2"), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match=r"rank=2: .*has shape \(4, 64\) in the checkpoint but \(2, 64\)"):
        other_rank.load_checkpoint(str(path / "actor"))


def test_a_run_with_other_lora_settings_does_not_resume_it(trained, tiny_model_dir):
    path, _, _, _, _ = trained
    assert not any(fnmatch.fnmatchcase(f"actor.lora.{k}", p) for k in ("rank", "alpha", "dropout", "target_modules")
                   for p in RESUME_SAFE)
    quiet = Console(quiet=True)

    def resume(*overrides):
        cfg = toy_config(tiny_model_dir, path.parent.parent, *CPU, f"checkpoint.resume={path}", *overrides)
        return CheckpointManager(cfg, path.parent.parent, quiet).resume_point()

    assert resume(*LORA).step == 2
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank 4 -> 0"):
        resume()
    with pytest.raises(ConfigError, match=r"actor\.lora\.alpha 8\.0 -> 16\.0"):
        resume("actor.lora.rank=4")
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only \(actor\.lora\.rank=4\) but this run has "
                                              r"actor\.lora\.rank=0"):
        resume("checkpoint.strict_config=false")


def test_a_checkpoint_saved_before_lora_existed_resumes_full_fine_tuning(tiny_model_dir, tmp_path):
    import yaml

    cfg = toy_config(tiny_model_dir, tmp_path, *CPU)
    saved = config_to_dict(cfg)
    del saved["actor"]["lora"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    manager = CheckpointManager(cfg, tmp_path, Console(quiet=True))
    manager._check_config(layout.Checkpoint(tmp_path, 2, {"step": 2}))  # no "actor.lora.rank (unset) -> 0"
    lora = toy_config(tiny_model_dir, tmp_path, *CPU, *LORA)
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank 0 -> 4"):
        CheckpointManager(lora, tmp_path, Console(quiet=True))._check_config(layout.Checkpoint(tmp_path, 2, {}))


def test_adapter_export_is_peft_format_and_gives_the_trained_logits(trained, tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path, _, _, batch, logits = trained
    out = tmp_path / "adapter"
    summary = export_checkpoint(str(path), str(out), lora="adapter")
    assert summary["kind"] == "adapter" and summary["step"] == 2
    # what PEFT itself writes for the same adapters on the same base
    ref = tmp_path / "peft"
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                   LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                              task_type="CAUSAL_LM")).save_pretrained(str(ref))
    ours, theirs = (json.loads((d / "adapter_config.json").read_text()) for d in (out, ref))
    assert ours.pop("base_model_name_or_path") == str(tiny_model_dir.resolve())
    theirs.pop("base_model_name_or_path")
    theirs["target_modules"] = sorted(theirs["target_modules"])
    assert ours == theirs
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(ref / "adapter_model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and a.metadata() == b.metadata()
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    torch.testing.assert_close(_logits(model, batch), logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 200_000])
def test_merged_export_loads_with_from_pretrained_and_gives_the_trained_logits(trained, tmp_path, max_shard_bytes):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path, _, _, batch, logits = trained
    out = tmp_path / "merged"
    summary = export_checkpoint(str(path), str(out), max_shard_bytes=max_shard_bytes)  # merged: the default
    assert summary["kind"] == "merged" and summary["dtype"] == "float32"
    assert (summary["files"] > 1) == (max_shard_bytes < 2**20)
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            assert not any("lora_" in k or "base_layer" in k for k in st.keys())
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    torch.testing.assert_close(_logits(model, batch), logits, atol=1e-5, rtol=0)


def test_export_command_lora_options(trained, tiny_model_dir, tmp_path, capsys):
    path, _, _, _, _ = trained
    from fitrl.cli import main

    def run(*argv):
        return main(["export", *argv])

    assert run(str(path), str(tmp_path / "a"), "--lora", "adapter", "--dtype", "bf16") == 0
    assert "LoRA adapter (PEFT)" in capsys.readouterr().out
    assert run(str(path), str(tmp_path / "b"), "--base", str(tmp_path / "moved")) == 2  # a mistake in the command
    assert f"is not at {tmp_path / 'moved'} (--base" in capsys.readouterr().err
    assert run(str(path), str(tmp_path / "c"), "--base", str(tiny_model_dir)) == 0
    capsys.readouterr()
    run_dir = tmp_path / "full_run"
    cfg = toy_config(tiny_model_dir, run_dir, *CPU)
    saved = CheckpointManager(cfg, run_dir, Console(quiet=True)).save(
        1, {"actor": RoleHandle(InProcessWorkerGroup(PolicyWorker, cfg))}, {"step": 1}, {})
    assert run(str(saved), str(tmp_path / "d"), "--lora", "adapter") == 2
    assert "holds the full policy" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------------------- slow

@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_exact_with_lora(tiny_model_dir, tmp_path):
    """tests/test_checkpoint_resume.py's exactness bar, with LoRA (and the KL loss, whose reference
    is the same policy with its adapters off)."""
    from fitrl.trainer.run import train

    overrides = [*COMMON, "actor.lora.rank=8", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.1"]
    steps = int(next(o for o in COMMON if o.startswith("trainer.max_steps=")).split("=")[1])
    train(toy_config(tiny_model_dir, tmp_path / "uninterrupted", *overrides))
    uninterrupted = comparable(read_metrics(tmp_path / "uninterrupted"))
    assert max(r.get("actor/kl_loss", 0) for r in uninterrupted) > 0  # the adapters moved the policy off its base

    kill_step = int(os.environ.get("FITRL_KILL_STEP") or random.randint(3, steps))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_model_dir), str(run), "step", str(kill_step),
                             *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # only if the hook never fired: end the child's own session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed (exit {proc.returncode}):\n{out[-3000:]}"
    newest = layout.list_complete(run / "checkpoints")[-1]
    assert newest.step == (kill_step - 1) // 2 * 2 and newest.adapter_only, f"killed in step {kill_step}"

    train(toy_config(tiny_model_dir, run, *overrides))  # checkpoint.resume=auto
    assert comparable(read_metrics(run)) == uninterrupted, f"killed in step {kill_step}, resumed at {newest.step}"


@pytest.mark.slow
def test_two_fsdp2_ranks_save_lora_one_process_resumes(ray_cluster, tiny_model_dir, tmp_path, batches):
    """tests/test_checkpoint_ray.py's resharding test with LoRA: the adapters and their AdamW
    moments saved by 2 FSDP2 ranks continue in one process as they would have on 2."""
    from fitrl.workers.ray_group import RayWorkerGroup

    first, second = batches  # rollouts of the base policy: a LoRA policy starts as its base (B = 0)
    with RayWorkerGroup(PolicyWorker, toy_config(tiny_model_dir, tmp_path, *BATCH, *LORA, *RAY), world_size=2,
                        name="policy") as group:
        two = RoleHandle(group)
        two.update(first)
        two.save_checkpoint(str(tmp_path / "actor"))
        saved = two.state_dict()
        m_two = two.update(second)
        after_two = two.state_dict()
    assert sorted(p.name for p in (tmp_path / "actor").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert layout_keys(tmp_path / "actor") <= {k for k in saved if ".lora_" in k}

    one = PolicyWorker(toy_config(tiny_model_dir, tmp_path, *BATCH, *LORA), rank=0, world_size=1)
    one.load_checkpoint(str(tmp_path / "actor"))
    assert worst(one.state_dict(), saved) == 0.0 and one.actor.num_updates == 1
    m_one = one.update(second)  # with the resharded AdamW moments
    assert m_one["actor/grad_norm"] == pytest.approx(m_two["actor/grad_norm"], rel=1e-5)
    assert worst(one.state_dict(), after_two) <= 1e-6


def layout_keys(role_dir) -> set[str]:
    from fitrl.checkpoint import sharded

    return {k.removeprefix("model.") for k in sharded.read_metadata(role_dir).state_dict_metadata
            if k.startswith("model.")}
