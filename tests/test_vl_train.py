"""GRPO on tiny vision-language models with generated pictures (examples/shapes_vl.yaml's task):
every family in one process, Qwen2.5-VL under Ray with 2 FSDP2 ranks and a KL reference, and a
resume that continues exactly. Marked slow (each run builds a model and trains a few steps)."""

import pytest

from fitrl.config import load_config
from helpers import ROOT, read_metrics

pytestmark = pytest.mark.slow

SHAPES = ROOT / "examples" / "shapes_vl.yaml"
DATA = ROOT / "examples" / "data"
SMALL = ["data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=4", "actor.micro_batch_size=8",
         "trainer.val_before_train=false", "data.val_files=[]", "memory.plan=off", "trainer.progress_bar=false"]


def shapes_config(model_dir, run_dir, *overrides):
    return load_config(str(SHAPES), [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{DATA / 'shapes_train.jsonl'}]", *SMALL, *overrides])


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, size="tiny", seed=0)
            for arch in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")}


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_grpo_steps_on_each_vl_family(vl_models, tmp_path, arch):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(shapes_config(vl_models[arch], run_dir, "trainer.max_steps=2"))
    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # the rollout's log-probs and the update's forward see the same images and positions
        assert r["rollout/logprob_diff_mean"] < 1e-5, r["rollout/logprob_diff_mean"]
        assert r["actor/grad_norm"] > 0


# (qwen2_5_vl: its two-rank FSDP2 update is matched against one process in tests/test_vl_family.py
# and its GRPO steps run in-process above; the Ray run would add nothing of its own)
@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_grpo_under_ray_with_two_fsdp_ranks_and_a_reference(ray_cluster, vl_models, tmp_path, arch):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(shapes_config(vl_models[arch], run_dir, "trainer.max_steps=2", "trainer.backend=ray",
                        "trainer.devices_per_node=2", "algorithm.use_kl_loss=true"))
    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert all(r["rollout/logprob_diff_mean"] < 1e-5 and "time/ref" in r for r in steps)


def test_vl_resume_continues_exactly(vl_models, tmp_path):
    """4 steps straight, or 2 steps, stop, and 2 more from the checkpoint: the same rewards
    (images are re-read from the data files; nothing about them lives in the checkpoint)."""
    from fitrl.trainer.run import train

    model = vl_models["qwen2_5_vl"]
    straight = train(shapes_config(model, tmp_path / "a", "trainer.max_steps=4"))
    common = ["checkpoint.save_freq=2"]
    train(shapes_config(model, tmp_path / "b", "trainer.max_steps=2", *common))
    resumed = train(shapes_config(model, tmp_path / "b", "trainer.max_steps=4", *common))
    assert [r["step"] for r in read_metrics(tmp_path / "b") if "reward/mean" in r] == [1, 2, 3, 4]
    want = [h["reward/mean"] for h in straight][2:]
    got = [h["reward/mean"] for h in resumed][-2:]
    assert got == pytest.approx(want, abs=1e-6)


def test_lora_on_a_vl_policy_with_the_base_as_reference(vl_models, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(shapes_config(vl_models["qwen2_5_vl"], run_dir, "trainer.max_steps=2", "actor.lora.rank=4",
                        "algorithm.use_kl_loss=true", "checkpoint.save_freq=2"))
    steps = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6) and steps[1]["actor/kl_loss"] > 0
    assert all(r["rollout/logprob_diff_mean"] < 1e-5 for r in steps)
    assert (run_dir / "checkpoints" / "step_2").is_dir()
