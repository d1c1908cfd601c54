"""Checkpoints in one process: atomic layout, role round trips, retention, resuming from a path,
and the messages for missing, corrupt and incompatible checkpoints."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from fitrl.checkpoint import layout
from fitrl.checkpoint.layout import CheckpointError
from fitrl.config import ConfigError
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.config.schema import SamplingConfig
from helpers import read_metrics, toy_config

SMALL = ["data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=2", "actor.micro_batch_size=8",
         "trainer.val_before_train=false"]
VOLATILE = ("time/", "mem/", "val/time", "perf/")  # wall-clock and memory readings differ run to run


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


# ----------------------------------------------------------------------------- layout (no torch)

def _fake_save(root, step, payload=b"x" * 10, metric=None):
    tmp = layout.begin(root, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "__0_0.distcp").write_bytes(payload)
    return layout.finalize(tmp, {"step": step, "metrics": {} if metric is None else {"val/reward/mean": metric}})


def test_layout_is_atomic_verifies_and_prunes(tmp_path):
    root = tmp_path / "checkpoints"
    for step, metric in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.2)]:
        _fake_save(root, step, metric=metric)
    interrupted = layout.begin(root, 5)  # a save that never finished
    (interrupted / "actor").mkdir()
    assert [c.step for c in layout.list_complete(root)] == [1, 2, 3, 4]
    assert layout.find(str(tmp_path)).step == 4  # a run directory: its newest complete checkpoint
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        layout.find(str(interrupted))
    assert layout.clean_partial(root) == [interrupted.name] and not interrupted.exists()

    # keep the newest 2, plus the best by the metric (step 2)
    removed = layout.prune(root, 2, "val/reward/mean", "max", protect=root / "step_4")
    assert sorted(p.name for p in removed) == ["step_1"]
    assert [c.step for c in layout.list_complete(root)] == [2, 3, 4]

    shard = root / "step_4" / "actor" / "__0_0.distcp"
    shard.write_bytes(b"x" * 4)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is 4 bytes, 10 when it was saved"):
        layout.read(root / "step_4")
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"missing actor/__0_0.distcp"):
        layout.read(root / "step_4")


# ----------------------------------------------------------------------------- one role, in process

@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A policy worker after one update on a fixed batch, and that batch."""
    cfg = toy_config(tiny_model_dir, tmp_path_factory.mktemp("run"), *SMALL, "trainer.device=cpu")
    worker = PolicyWorker(cfg, rank=0, world_size=1)
    tok = worker.tokenizer
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + 2?"}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for i in range(4)]
    torch.manual_seed(0)
    batch = worker.generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=2, max_tokens=6))
    batch.update(worker.compute_logprob(batch))
    batch.update(advantages=torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1))
                 * batch["response_mask"])
    worker.update(batch)
    return cfg, worker, batch


def test_role_state_round_trip(trained, tmp_path):
    cfg, worker, batch = trained
    worker.save_checkpoint(str(tmp_path / "actor"))
    fresh = PolicyWorker(cfg, rank=0, world_size=1)
    fresh.load_checkpoint(str(tmp_path / "actor"))
    for (k, a), b in zip(worker.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sb = worker.actor.optimizer.state_dict(), fresh.actor.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert fresh.actor.num_updates == worker.actor.num_updates == 1
    assert fresh.actor.scheduler.state_dict() == worker.actor.scheduler.state_dict()
    # and they go on identically
    m1, m2 = worker.update(batch), fresh.update(batch)
    assert m1 == m2
    assert all(torch.equal(a, b) for a, b in zip(worker.model.parameters(), fresh.model.parameters()))


def _other_shape_model(src, dst):
    """The tiny model with a narrower MLP: same tensor names, different shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    config.intermediate_size //= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, dst / f.name)
    return dst


def test_incompatible_or_corrupt_role_checkpoints_name_the_file(trained, tiny_model_dir, tmp_path):
    cfg, worker, _ = trained
    good = tmp_path / "actor"
    worker.save_checkpoint(str(good))

    other = toy_config(_other_shape_model(tiny_model_dir, tmp_path / "narrow"), tmp_path / "r", *SMALL)
    with pytest.raises(CheckpointError, match=r"\.metadata does not match actor\.model\.path=.*narrow: "
                                              r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        PolicyWorker(other, rank=0, world_size=1).load_checkpoint(str(good))

    fresh = PolicyWorker(cfg, rank=0, world_size=1)
    broken = tmp_path / "truncated"
    shutil.copytree(good, broken)
    shard = broken / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"truncated/__0_0\.distcp is truncated: 1000 bytes"):
        fresh.load_checkpoint(str(broken))
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"truncated is missing shard file __0_0\.distcp"):
        fresh.load_checkpoint(str(broken))
    (broken / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"truncated has no \.metadata"):
        fresh.load_checkpoint(str(broken))


# ----------------------------------------------------------------------------- through the trainer

@pytest.mark.slow
def test_keep_last_and_best_and_model_only(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    train(toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=4", "trainer.val_freq=1",
                     "checkpoint.save_freq=1", "checkpoint.save_limit=1", "checkpoint.keep_best=val/reward/mean",
                     "checkpoint.keep_best_mode=min"))
    vals = {r["step"]: r["val/reward/mean"] for r in read_metrics(run)
            if "val/reward/mean" in r and "reward/mean" not in r}  # the validation records
    best = min(vals, key=lambda s: (vals[s], s))  # ties: the earliest is kept
    kept = {c.step for c in layout.list_complete(run / "checkpoints")}
    assert kept == {4, best}, (kept, vals)

    weights = tmp_path / "weights"
    train(toy_config(tiny_model_dir, weights, *SMALL, "trainer.max_steps=1", "data.val_files=[]",
                     "checkpoint.model_only=true"))
    point = layout.read(weights / "checkpoints" / "step_1")
    assert point.model_only and not any("optim" in f for f in point.meta["files"])
    with pytest.raises(CheckpointError, match="holds weights only"):
        train(toy_config(tiny_model_dir, tmp_path / "again", *SMALL, f"checkpoint.resume={point.path}"))


@pytest.mark.parametrize("preset", [
    [],
    # a critic (GAE) and the adaptive KL controller in the reward: both are part of the state
    ["algorithm.adv_estimator=gae", "algorithm.kl_in_reward.enable=true", "algorithm.kl_in_reward.controller=adaptive",
     "critic.mini_batch_size=2", "critic.micro_batch_size=8", "critic.warmup_steps=1"],
], ids=["grpo", "gae-critic-adaptive-kl"])
@pytest.mark.slow
def test_resume_from_path_into_new_run_matches(tiny_model_dir, tmp_path, preset):
    """Resuming another run's step-2 checkpoint in a fresh run directory reproduces that run."""
    from fitrl.trainer.run import train

    common = [*SMALL, *preset, "trainer.max_steps=4", "trainer.val_freq=2", "checkpoint.save_freq=2"]
    train(toy_config(tiny_model_dir, tmp_path / "a", *common))
    train(toy_config(tiny_model_dir, tmp_path / "b", *common,
                     f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_2'}"))
    records = read_metrics(tmp_path / "b")
    assert comparable(records) == comparable(read_metrics(tmp_path / "a"))
    assert [c.step for c in layout.list_complete(tmp_path / "b" / "checkpoints")] == [4]  # b began after step 2
    if preset:
        steps = [r for r in records if "reward/mean" in r]
        assert "critic/vf_loss" in steps[-1]
        assert steps[1]["kl_in_reward/coef"] != steps[3]["kl_in_reward/coef"]  # the controller moved


def test_resume_choices_and_config_mismatch(tiny_model_dir, tmp_path):
    from rich.console import Console

    from fitrl.checkpoint.manager import CheckpointManager
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    train(toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=1", "data.val_files=[]"))
    quiet = Console(quiet=True)

    def point(*overrides):
        cfg = toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=1", "data.val_files=[]", *overrides)
        return CheckpointManager(cfg, Path(cfg.trainer.run_dir or tmp_path / "new"), quiet).resume_point()

    assert point().step == 1                                 # auto, trainer.run_dir set
    assert point("checkpoint.resume=never") is None
    assert point("trainer.run_dir=null") is None             # auto needs a stable trainer.run_dir
    assert point(f"checkpoint.resume={run}", "trainer.run_dir=null").step == 1
    assert point("trainer.max_steps=5", "actor.micro_batch_size=4").step == 1  # safe changes
    with pytest.raises(ConfigError, match=r"step_1/config\.yaml\): actor\.optim\.lr 0\.002 -> 0\.001"):
        point("actor.optim.lr=1e-3")
    assert point("actor.optim.lr=1e-3", "checkpoint.strict_config=false").step == 1
    with pytest.raises(CheckpointError, match="does not exist"):
        point(f"checkpoint.resume={tmp_path / 'nowhere'}")
    # a finished run resumed again has nothing to train
    assert len(train(toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=1", "data.val_files=[]"))) == 1
    assert json.loads((run / "checkpoints" / "step_1" / "COMPLETE").read_text())["world_size"] == 1


def test_resume_with_a_changed_lr_trains_on_the_configured_lr(tmp_path, tiny_model_dir, finished_run):
    """checkpoint.strict_config=false accepts a new actor.optim.lr: the restored optimizer and
    scheduler must not keep the checkpoint's (the finished run trained 2 steps at 2e-3, warm-up 2)."""
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    cfg = toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=3", "data.val_files=[]",
                     "actor.mini_batch_size=4", "actor.micro_batch_size=16", "rollout.n=4",
                     "actor.optim.lr=1e-4", "checkpoint.strict_config=false", "trainer.num_threads=1")
    train(cfg)
    steps = [r for r in read_metrics(run) if "actor/lr" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[1]["actor/lr"] == pytest.approx(2e-3)   # the finished run's last step, past warm-up
    assert steps[2]["actor/lr"] == pytest.approx(1e-4)   # resumed: the configured peak lr
