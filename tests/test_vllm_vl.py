"""The vLLM engine with tiny Qwen-VL models, images and videos (examples/shapes_vl.yaml's task), on
CPU in .venv-vllm: the engine's log-probs equal the trainer's with images and videos in the
prompts, after every push of a GRPO run whose reward rises."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import json  # noqa: E402

from fitrl.trainer.verdict import judge_rise  # noqa: E402
from fitrl.config import load_config  # noqa: E402
from fitrl.roles.workers import PolicyWorker  # noqa: E402
from helpers import ROOT  # noqa: E402
from vllm_helpers import HEAD_DIM  # noqa: E402

SHAPES = ROOT / "examples" / "shapes_vl.yaml"
DATA = ROOT / "examples" / "data"


def shapes_config(model_dir, run_dir, *overrides):
    return load_config(str(SHAPES), [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}", f"data.train_files=[{DATA / 'shapes_train.jsonl'}]",
        "data.val_files=[]", "trainer.val_before_train=false", "memory.plan=off", "trainer.progress_bar=false",
        "rollout.engine=vllm", *overrides])


def vl_model(root, arch: str):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(root / arch, arch=arch, size="tiny", seed=0, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vl_model(tmp_path_factory.mktemp("models"), "qwen2_5_vl")


# (qwen2_vl's engine path, its multimodal rope included, is the video test's below)
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_logprobs_with_images_equal_the_trainers(arch, tmp_path):
    w = PolicyWorker(shapes_config(vl_model(tmp_path, arch), tmp_path / "run", "rollout.temperature=0.7", "rollout.top_k=20",
                                   "rollout.top_p=0.9", "rollout.max_response_length=8"), rank=0, world_size=1)
    from fitrl.trainer.run import build_datasets

    train, _ = build_datasets(w.cfg, w.tokenizer)
    images = {i: (len(m["image_grid_thw"]) if (m := train.multi_modal_inputs(i)) else 0) for i in range(len(train))}
    # rows with two pictures (two runs of image pads), one picture, and none
    chosen = ([i for i, n in images.items() if n == 2][:4] + [i for i, n in images.items() if n == 1][:8]
              + [i for i, n in images.items() if n == 0][:2])
    assert sorted({images[i] for i in chosen}) == [0, 1, 2]
    prompts = train.batch(chosen, "vl")
    out = w.generate(prompts, w.cfg.rollout.sampling())
    trainer = w.compute_logprob(out)["old_logprobs"]
    gap = float(((trainer - out["rollout_logprobs"]).abs() * out["response_mask"]).max())
    assert out["response_mask"].sum() > 0 and gap <= 1e-4, gap
    pads = set(w.rollout.inputs.never_generate)
    assert not any(t in pads for t in out["responses"][out["response_mask"].bool()].tolist())


def test_grpo_with_images_and_vllm_rollouts(model_dir, tmp_path):
    from fitrl.trainer.run import train

    history = train(shapes_config(model_dir, tmp_path / "run", "trainer.max_steps=30"))
    assert max(h["rollout/logprob_diff_max"] for h in history) <= 1e-4
    verdict = judge_rise([h["reward/mean"] for h in history])
    assert verdict["rose"], verdict["message"]


def video_rows(path):
    """Rows with one video (3 frames: padded to 4), a video and a picture, two videos, and a picture
    alone; the frames are shapes pictures (112x112, resized to 56x56)."""
    pics = sorted(str(p) for p in (DATA / "shapes").glob("train_00*_0.png"))[:6]
    rows = [{"prompt": "<video>What moves?", "videos": [pics[:3]], "images": []},
            {"prompt": "<image>then<video>: which?", "videos": [pics[2:6]], "images": [pics[0]]},
            {"prompt": "<video><video>Same?", "videos": [pics[:2], pics[3:5]], "images": []},
            {"prompt": "<image>Which colour?", "videos": [], "images": [pics[1]]}]
    path.write_text("".join(json.dumps({**r, "answer": "A", "choices": ["A", "B"]}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_logprobs_with_videos_equal_the_trainers(arch, tmp_path):
    """Videos reach vLLM as the trainer's sampled, padded and resized frames; Qwen2.5-VL's temporal
    positions follow data.video_fps (4 here, not the processor's default 2)."""
    data = video_rows(tmp_path / "videos.jsonl")
    cfg = shapes_config(vl_model(tmp_path, arch), tmp_path / "run", f"data.train_files=[{data}]", "data.video_key=videos",
                        "data.video_fps=4", "data.max_frames=4", "data.video_max_pixels=6272", "data.rollout_batch_size=4",
                        "rollout.temperature=0.7", "rollout.max_response_length=8", "rollout.ignore_eos=true")
    w = PolicyWorker(cfg, rank=0, world_size=1)
    from fitrl.trainer.run import build_datasets

    train, _ = build_datasets(w.cfg, w.tokenizer)
    grids = [train.multi_modal_inputs(i).get("video_grid_thw") for i in range(len(train))]
    assert [g.tolist() if g is not None else None for g in grids][:3] == [[[2, 4, 4]], [[2, 4, 4]], [[1, 4, 4]] * 2]
    out = w.generate(train.batch(list(range(len(train))), "video"), w.cfg.rollout.sampling())
    trainer = w.compute_logprob(out)["old_logprobs"]
    gap = float(((trainer - out["rollout_logprobs"]).abs() * out["response_mask"]).max())
    assert int(out["response_mask"].sum()) == 4 * 8 * 8 and gap <= 1e-4, gap
