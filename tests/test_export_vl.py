"""`fitrl export` of a vision-language policy: the exported directory loads offline with
``AutoModelForImageTextToText`` and gives the checkpoint's logits on a prompt with an image, and
the image processor's files go with it."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer  # noqa: E402

from fitrl.checkpoint import layout, sharded  # noqa: E402
from fitrl.checkpoint.export import export_checkpoint  # noqa: E402
from fitrl.checkpoint.layout import CheckpointError  # noqa: E402
from fitrl.checkpoint.manager import WEIGHT_FILES  # noqa: E402
from fitrl.models.tiny import make_tiny_model  # noqa: E402
from test_tiny_vl_models import image_prompt, picture  # noqa: E402

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja")


def save_checkpoint(model, model_dir, root, step: int):
    """A checkpoint as the trainer lays it out (the actor's sharded weights, the model directory's
    other files under hf/), written from one in-process model: no run, no optimizer."""
    import fnmatch

    tmp = layout.begin(root, step)
    sharded.save_role(tmp / "actor", model, None, None, rank=0)
    (tmp / "hf").mkdir()
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and not any(fnmatch.fnmatch(f.name, p) for p in WEIGHT_FILES):
            shutil.copy2(f, tmp / "hf" / f.name)
    return layout.finalize(tmp, {"step": step, "world_size": 1, "roles": ["actor"], "model_only": True,
                                 "adapter_only": False})


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def vl_checkpoint(request, tmp_path_factory):
    """A tiny VL policy with every weight moved off its initial value, saved as step 3, with its
    logits on a prompt holding an image."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_model(root / "model", arch=request.param, size="tiny", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    images = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    inputs, _ = image_prompt(tok, images, model, picture())
    with torch.no_grad():
        logits = model(**inputs).logits
    path = save_checkpoint(model, model_dir, root / "checkpoints", 3)
    return path, inputs, logits


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_export_loads_with_image_text_to_text_and_gives_the_logits(vl_checkpoint, tmp_path, dtype):
    path, inputs, trained = vl_checkpoint
    out = tmp_path / "hf"
    summary = export_checkpoint(str(path), str(out), dtype=dtype)
    assert summary["step"] == 3 and summary["auto_class"] == "AutoModelForImageTextToText"
    for name in PROCESSOR_FILES:
        assert (out / name).read_bytes() == (path / "hf" / name).read_bytes(), name
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True).eval()
    assert model.dtype == (torch.bfloat16 if dtype else torch.float32)
    images = AutoImageProcessor.from_pretrained(out, local_files_only=True)
    assert images.patch_size == model.config.vision_config.patch_size
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template
    if dtype:
        inputs = dict(inputs, pixel_values=inputs["pixel_values"].to(torch.bfloat16))
    with torch.no_grad():
        logits = model(**inputs).logits.float()
    if dtype is None:
        assert torch.equal(logits, trained)
    else:
        torch.testing.assert_close(logits, trained, atol=0.1, rtol=0.05)


def test_export_without_the_image_processor_config_fails_before_writing(vl_checkpoint, tmp_path):
    path, _, _ = vl_checkpoint
    broken = tmp_path / "checkpoints" / path.name
    shutil.copytree(path, broken)
    (broken / "hf" / "preprocessor_config.json").unlink()
    marker = json.loads((broken / layout.MARKER).read_text())  # the copy stays a consistent checkpoint
    del marker["files"]["hf/preprocessor_config.json"], marker["hashes"]["hf/preprocessor_config.json"]
    (broken / layout.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="has no hf/preprocessor_config.json: .* is a vision-language model"):
        export_checkpoint(str(broken), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
