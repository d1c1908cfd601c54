"""`fitrl export`: a checkpoint's policy as a Hugging Face directory that gives the trained
model's logits."""

import json

import pytest
import torch

from fitrl.checkpoint import layout
from fitrl.checkpoint.export import export_checkpoint
from fitrl.checkpoint.manager import CheckpointManager
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.workers.group import InProcessWorkerGroup, RoleHandle
from helpers import toy_config


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_model_dir, tmp_path_factory):
    """A policy after two updates (weights far from the initial ones), saved as step 2, and its
    logits on a batch of prompts."""
    from rich.console import Console

    run = tmp_path_factory.mktemp("run")
    cfg = toy_config(tiny_model_dir, run, "trainer.device=cpu", "actor.optim.lr=1e-2")
    policy = RoleHandle(InProcessWorkerGroup(PolicyWorker, cfg))
    worker: PolicyWorker = policy.group.workers[0]
    tok = worker.tokenizer
    ids = tok([f"What is {i} + {i}?" for i in range(4)], return_tensors="pt", padding=True)
    batch = Batch({"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]})
    for _ in range(2):
        rollout = policy.generate(Batch(fields={"prompt_ids": ids["input_ids"].tolist()}), _sampling())
        rollout.update(policy.compute_logprob(rollout))
        rollout.update(advantages=torch.randn(len(rollout), 1) * rollout["response_mask"])
        policy.update(rollout)
    with torch.no_grad():
        logits = worker.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        initial = PolicyWorker(cfg, rank=0, world_size=1).model(input_ids=batch["input_ids"],
                                                                attention_mask=batch["attention_mask"]).logits
    assert (logits - initial).abs().max() > 0.1  # training moved the weights: the comparison means something
    path = CheckpointManager(cfg, run, Console(quiet=True)).save(2, {"actor": policy}, {"step": 2}, {})
    return path, batch, logits


def _sampling():
    from fitrl.config.schema import SamplingConfig

    return SamplingConfig(n=2, max_tokens=6)


@pytest.mark.parametrize("dtype,atol", [(None, 0.0), ("bf16", 0.1)])
def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(trained_checkpoint, tmp_path, dtype, atol):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path, batch, trained = trained_checkpoint
    out = tmp_path / "hf"
    summary = export_checkpoint(str(path), str(out), dtype=dtype)
    assert summary["step"] == 2 and (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == (torch.bfloat16 if dtype else torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    torch.testing.assert_close(logits, trained, atol=atol, rtol=0 if dtype is None else 0.05)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template and tok("What is 1 + 1?")["input_ids"]
    assert GenerationConfig.from_pretrained(out).eos_token_id is not None


def test_export_in_several_files_with_an_index(trained_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    path, batch, trained = trained_checkpoint
    out = tmp_path / "hf"
    summary = export_checkpoint(str(path), str(out), max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert summary["files"] > 1 and len(set(index["weight_map"].values())) == summary["files"]
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, trained)


def test_export_command_exit_codes(trained_checkpoint, tmp_path, capsys):
    path, _, _ = trained_checkpoint
    from fitrl.cli import main

    def run(*argv):
        return main(["export", *argv])

    assert run(str(path.parent.parent), str(tmp_path / "a"), "--dtype", "bf16") == 0  # a run dir: its newest
    assert "wrote" in capsys.readouterr().out
    assert run(str(path), str(tmp_path / "a")) == 2  # the user's mistakes: exit 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert run(str(tmp_path / "missing"), str(tmp_path / "b")) == 2
    assert "does not exist" in capsys.readouterr().err
    partial = layout.begin(path.parent, 9)
    assert run(str(partial), str(tmp_path / "c")) == 1
    assert "no COMPLETE marker" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
