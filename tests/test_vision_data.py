"""Tests for the vision-language data path: fitrl.data.images (loading, checks, the pixel budget),
fitrl/models/families/qwen_vl/media.py (spec, processing, placeholders); PromptDataset with images and videos is in
tests/test_vision_dataset.py.

Pixel budgets and token counts are computed by hand; processing is compared with transformers'
own ``Qwen2VLImageProcessorPil``; every bad-image case is checked in both ``on_bad_image`` modes.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fitrl.core.errors import DataError, ModelDirError
from fitrl.data.images import BadImage, image_tokens, load_image, smart_resize
from fitrl.models.families.qwen_vl.media import (VisionSpec, expand_placeholders, frames_from_pixels, images_from_pixels,
                                                  insert_vision_markers, process_images, process_videos, sample_frames)
from vision_helpers import CHATML, MARK, QWEN2, QWEN3, QWEN25, encode, gif_animated, png_header, rgb, tokenizer  # noqa: F401

# ------------------------------------------------------------------------------ pixel budget


@pytest.mark.parametrize("h, w, factor, min_px, max_px, want, tokens", [
    # 100x200 at most 28*28*16: rounding gives 112x196 = 21952 > 12544, so beta = sqrt(20000/12544)
    # = 1.2627; floor(100/1.2627/28) = 2 -> 56, floor(200/1.2627/28) = 5 -> 140; 4x10 patches -> 10 tokens
    (100, 200, 28, 3136, 28 * 28 * 16, (56, 140), 10),
    # inside the budget: sides rounded to the nearest multiple of 28
    (100, 100, 28, 3136, 1048576, (112, 112), 16),
    (224, 224, 28, 3136, 1048576, (224, 224), 64),
    (300, 500, 28, 3136, 1048576, (308, 504), 198),  # 22x36 patches
    # too small: 10x20 rounds to 0x28 < 3136, beta = sqrt(3136/200) = 3.96;
    # ceil(10*3.96/28) = ceil(1.41) = 2 -> 56, ceil(20*3.96/28) = ceil(2.83) = 3 -> 84; 4x6 patches -> 6 tokens
    (10, 20, 28, 3136, 1048576, (56, 84), 6),
    # Qwen3-VL (patch 16, factor 32): 96x192 = 18432 > 16384, beta = sqrt(20000/16384) = 1.105 -> 64x160
    (100, 200, 32, 4096, 32 * 32 * 16, (64, 160), 10),
])
def test_smart_resize_by_hand(h, w, factor, min_px, max_px, want, tokens):
    assert smart_resize(h, w, factor=factor, min_pixels=min_px, max_pixels=max_px) == want
    assert image_tokens(h, w, VisionSpec("x", patch_size=factor // 2), min_px, max_px) == tokens


def test_image_tokens_by_hand():
    assert image_tokens(100, 200, QWEN25, 3136, 28 * 28 * 16) == 10   # 56x140: 4x10 patches / 4
    assert image_tokens(224, 224, QWEN25, 3136, 1048576) == 64        # 16x16 patches / 4
    assert image_tokens(300, 500, QWEN25, 3136, 1048576) == 198       # 308x504: 22x36 patches / 4
    assert image_tokens(100, 200, QWEN3, 4096, 32 * 32 * 16) == 10     # 64x160: 4x10 patches / 4
    # the budget in tokens is about max_pixels / (patch * merge)**2
    assert image_tokens(4000, 3000, QWEN25, 3136, 28 * 28 * 256) <= 256


def test_smart_resize_matches_transformers():
    # the PIL module's copy: image_processing_qwen2_vl itself imports torchvision
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    for _ in range(400):
        h, w = (int(x) for x in rng.integers(1, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        factor = int(rng.choice([28, 32]))
        lo = int(rng.integers(1, 100000))
        hi = lo + int(rng.integers(0, 2000000))
        assert smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi) == \
            hf_smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi), (h, w, factor, lo, hi)


def test_aspect_ratio_over_200_is_a_bad_image():
    with pytest.raises(BadImage, match="aspect ratio over 200") as e:
        smart_resize(1, 201, factor=28, min_pixels=3136, max_pixels=1048576)
    assert e.value.kind == "aspect ratio"
    assert smart_resize(1, 200, factor=28, min_pixels=3136, max_pixels=1048576)  # exactly 200 is allowed


# ------------------------------------------------------------------------------ loading


def test_load_image_from_every_kind_of_value(tmp_path):
    img = rgb(20, 30)
    (tmp_path / "a.png").write_bytes(encode(img))
    want = np.asarray(img)
    for value in ["a.png", str(tmp_path / "a.png"), encode(img), {"bytes": encode(img), "path": "ignored.png"},
                  {"bytes": None, "path": "a.png"}, img]:
        out = load_image(value, base_dir=str(tmp_path))
        assert out.mode == "RGB" and np.array_equal(np.asarray(out), want), type(value)


def test_modes_convert_to_rgb_with_alpha_on_white():
    # CMYK: (C, M, Y, K) -> 255 * (1 - C) * (1 - K) per channel
    out = load_image(encode(Image.new("CMYK", (2, 2), (0, 255, 0, 0)), "JPEG", quality=100))
    assert out.mode == "RGB"
    assert np.allclose(np.asarray(out)[0, 0], (255, 0, 255), atol=3)
    assert np.asarray(load_image(encode(Image.new("L", (2, 2), 77)))).tolist() == [[[77] * 3] * 2] * 2
    # fully transparent pixels become white, not black; half transparent blends toward white
    assert np.asarray(load_image(encode(Image.new("RGBA", (2, 2), (0, 0, 0, 0)))))[0, 0].tolist() == [255, 255, 255]
    assert np.asarray(load_image(encode(Image.new("RGBA", (2, 2), (200, 0, 0, 255)))))[0, 0].tolist() == [200, 0, 0]
    half = np.asarray(load_image(encode(Image.new("RGBA", (2, 2), (0, 0, 0, 128)))))[0, 0]
    assert np.allclose(half, 127, atol=1)
    assert np.asarray(load_image(encode(Image.new("LA", (2, 2), (10, 0)))))[0, 0].tolist() == [255, 255, 255]
    assert np.asarray(load_image(encode(Image.new("LA", (2, 2), (10, 255)))))[0, 0].tolist() == [10, 10, 10]
    # palette without transparency, and with a transparent index
    p = Image.new("P", (2, 2), 1)
    p.putpalette([0, 0, 0, 30, 60, 90] + [0] * 762)
    assert np.asarray(load_image(encode(p)))[0, 0].tolist() == [30, 60, 90]
    buf = io.BytesIO()
    p.save(buf, "PNG", transparency=1)
    assert np.asarray(load_image(buf.getvalue()))[0, 0].tolist() == [255, 255, 255]
    # 16-bit grey is scaled to 8 bits (PIL's own conversion would clip 40000 to 255)
    g16 = Image.fromarray(np.full((2, 2), 40000, dtype=np.uint16))
    g16_png = encode(g16)
    assert Image.open(io.BytesIO(g16_png)).mode.startswith("I")
    assert np.asarray(load_image(g16_png))[0, 0].tolist() == [40000 >> 8] * 3


@pytest.mark.parametrize("value, kind, reason", [
    ("nope.png", "missing file", "file not found"),
    (b"", "empty file", r"empty image bytes \(0 bytes\)"),
    (b"this is not an image", "not an image", "not an image or corrupt"),
    (encode(rgb(64, 64))[:3000], "truncated", "truncated file"),
    (encode(rgb(64, 64), "JPEG")[:1000], "truncated", "truncated file"),
    (png_header(0, 10), "zero size", r"zero-size image \(0x10\)"),
    (png_header(20000, 16), "too large", "20000x16, a side over data.max_image_side=16384"),
    (png_header(100000, 100000), "too large", "too many pixels to decode safely"),
    (gif_animated(), "animated", r"animated image \(3 frames\); use a video column for frames"),
])
def test_bad_images(tmp_path, value, kind, reason):
    with pytest.raises(BadImage, match=reason) as e:
        load_image(value, base_dir=str(tmp_path), max_side=16384)
    assert e.value.kind == kind


def test_truncated_is_refused_even_if_pil_was_told_to_accept_it():
    from PIL import ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        with pytest.raises(BadImage, match="truncated"):
            load_image(encode(rgb(64, 64), "JPEG")[:1000])
        assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_zero_byte_file_zero_size_pil_and_small_max_side(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(BadImage, match=r"empty file \(0 bytes\)"):
        load_image("empty.png", base_dir=str(tmp_path))
    with pytest.raises(BadImage, match=r"zero-size image \(0x3\)"):
        load_image(Image.new("RGB", (0, 3)))
    with pytest.raises(BadImage, match="100x50, a side over data.max_image_side=64"):
        load_image(encode(rgb(50, 100)), max_side=64)


# ------------------------------------------------------------------------------ processing


@pytest.mark.parametrize("spec", [QWEN25, QWEN3], ids=["qwen2_5_vl", "qwen3_vl"])
def test_process_images_equals_the_transformers_processor(spec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = [rgb(100, 200, 1), rgb(37, 41, 2), rgb(300, 120, 3)]
    lo, hi = 3136, 28 * 28 * 40
    ours = process_images(images, spec, lo, hi)
    hf = Qwen2VLImageProcessorPil(min_pixels=lo, max_pixels=hi, patch_size=spec.patch_size,
                                  merge_size=spec.merge_size, temporal_patch_size=spec.temporal_patch_size,
                                  image_mean=list(spec.image_mean), image_std=list(spec.image_std))(
        images=images, return_tensors="pt")
    assert torch.equal(ours["pixel_values"], hf["pixel_values"])
    assert torch.equal(ours["image_grid_thw"], hf["image_grid_thw"])
    assert ours["pixel_values"].dtype == torch.float32 and ours["image_grid_thw"].dtype == torch.int64
    p = spec.patch_size
    for img, (t, gh, gw) in zip(images, ours["image_grid_thw"].tolist()):
        h, w = smart_resize(img.height, img.width, factor=spec.factor, min_pixels=lo, max_pixels=hi)
        assert (t, gh, gw) == (1, h // p, w // p)
    assert ours["pixel_values"].shape == (int(ours["image_grid_thw"].prod(-1).sum()), 3 * 2 * p * p)


def test_sample_frames():
    assert sample_frames(10, 4) == [0, 2, 5, 7]
    assert sample_frames(3, 16) == [0, 1, 2]
    assert sample_frames(16, 16) == list(range(16))
    assert sample_frames(17, 16)[0] == 0 and len(sample_frames(17, 16)) == 16


def test_video_patch_layout_by_hand():
    """patch 1, merge 2, temporal 2, mean 0, std 1: a row is one patch of the 2x2 merge block in
    (row, column) order, holding channel-major, then time, values x / 255."""
    spec = VisionSpec("qwen2_5_vl", patch_size=1, merge_size=2, temporal_patch_size=2,
                      image_mean=(0.0,) * 3, image_std=(1.0,) * 3)
    f0 = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)          # (H, W, C)
    f1 = f0 + 100
    out = process_videos([[Image.fromarray(f0), Image.fromarray(f1)]], spec, fps=4.0, max_frames=8,
                         max_pixels=4, min_pixels=1)
    assert out["video_grid_thw"].tolist() == [[1, 2, 2]]
    want = [[f[i, j, c] / 255 for c in range(3) for f in (f0, f1)] for i in range(2) for j in range(2)]
    assert torch.allclose(out["pixel_values_videos"], torch.tensor(want, dtype=torch.float32))
    assert out["second_per_grid_ts"].tolist() == [0.5]  # temporal_patch_size / fps


def test_video_of_one_repeated_image_equals_the_image():
    img = rgb(90, 130)
    a = process_images([img], QWEN25, 3136, 28 * 28 * 20)
    b = process_videos([[img, img]], QWEN25, fps=2.0, max_frames=4, max_pixels=28 * 28 * 20, min_pixels=3136)
    assert torch.equal(a["pixel_values"], b["pixel_values_videos"])
    assert torch.equal(a["image_grid_thw"], b["video_grid_thw"])


def test_video_frames_subsampled_padded_and_resized_to_the_first():
    frames = [rgb(56, 84, s) for s in range(9)] + [rgb(200, 100, 9)]  # the last frame has another size
    out = process_videos([frames, frames[:3]], QWEN25, fps=2.0, max_frames=5, max_pixels=56 * 84, min_pixels=3136)
    # video 1: 10 frames -> 5 sampled -> padded to 6 -> grid_t 3; video 2: 3 frames -> 4 -> grid_t 2
    assert out["video_grid_thw"].tolist() == [[3, 4, 6], [2, 4, 6]]
    assert out["pixel_values_videos"].shape == (3 * 24 + 2 * 24, 3 * 2 * 14 * 14)
    assert out["second_per_grid_ts"].tolist() == [1.0, 1.0]
    # the padding repeats the last frame: in video 2's second temporal patch both halves are frame 2
    last = out["pixel_values_videos"][3 * 24 + 24:].reshape(24, 3, 2, 14 * 14)
    assert torch.equal(last[:, :, 0], last[:, :, 1])
    # Qwen2-VL's model takes no second_per_grid_ts; Qwen3-VL videos are refused
    assert "second_per_grid_ts" not in process_videos([frames[:2]], QWEN2, fps=2.0, max_frames=4,
                                                      max_pixels=56 * 84, min_pixels=3136)
    with pytest.raises(DataError, match="videos are not supported for qwen3_vl yet"):
        process_videos([frames[:2]], QWEN3, fps=2.0, max_frames=4, max_pixels=56 * 84, min_pixels=3136)


@pytest.mark.parametrize("spec", [QWEN2, QWEN25])
def test_pixels_back_to_the_resized_images_and_frames_exactly(spec):
    """What an engine taking pictures (vLLM) is given: the resized 8-bit pixels, recovered exactly
    from the patches (re-patchified, they are the trainer's patches again)."""
    lo, hi = 3136, 56 * 84
    images = [rgb(90, 130, 1), rgb(40, 300, 2)]
    ours = process_images(images, spec, lo, hi)
    back = images_from_pixels(ours["pixel_values"], ours["image_grid_thw"], spec)
    for img, got in zip(images, back):
        h, w = smart_resize(img.height, img.width, factor=spec.factor, min_pixels=lo, max_pixels=hi)
        assert got.size == (w, h)
        want = np.asarray(img.resize((w, h), resample=Image.Resampling.BICUBIC))
        assert np.array_equal(np.asarray(got), want)
    assert torch.equal(process_images(back, spec, lo, hi)["pixel_values"], ours["pixel_values"])

    frames = [rgb(56, 84, s) for s in range(5)]
    vids = process_videos([frames, frames[:2]], spec, fps=2.0, max_frames=8, max_pixels=hi, min_pixels=lo)
    got = frames_from_pixels(vids["pixel_values_videos"], vids["video_grid_thw"], spec)
    assert [v.shape for v in got] == [(6, 56, 84, 3), (2, 56, 84, 3)]  # 5 frames padded to 6 with the last
    assert all(np.array_equal(got[0][i], np.asarray(frames[min(i, 4)])) for i in range(6))
    again = process_videos([[Image.fromarray(f) for f in v] for v in got], spec, fps=2.0, max_frames=8,
                           max_pixels=hi, min_pixels=lo)
    assert torch.equal(again["pixel_values_videos"], vids["pixel_values_videos"])


# ------------------------------------------------------------------------------ prompt text


def test_markers_and_expansion():
    msgs = [{"role": "user", "content": "<image> left, <image> right"}]
    out = insert_vision_markers(msgs, 2, 0, spec=QWEN25, image_placeholder="<image>", video_placeholder="<video>")
    assert out[0]["content"] == f"{MARK} left, {MARK} right"
    assert msgs[0]["content"] == "<image> left, <image> right"  # not edited in place
    out = insert_vision_markers([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], 2, 1,
                                spec=QWEN25, image_placeholder="<image>", video_placeholder="<video>")
    assert out[1]["content"] == "<|vision_start|><|video_pad|><|vision_end|>" + MARK * 2 + "q"
    with pytest.raises(BadImage, match="2 <image> placeholders but 1 image"):
        insert_vision_markers(msgs, 1, 0, spec=QWEN25, image_placeholder="<image>", video_placeholder="<video>")
    with pytest.raises(BadImage, match="1 <video> placeholder but 0 videos"):
        insert_vision_markers([{"role": "user", "content": "<video>"}], 0, 0, spec=QWEN25,
                              image_placeholder="<image>", video_placeholder="<video>")
    text = f"a{MARK}b<|vision_start|><|video_pad|><|vision_end|>c{MARK}"
    assert expand_placeholders(text, [2, 3], [1], QWEN25) == (
        "a<|vision_start|>" + "<|image_pad|>" * 2 + "<|vision_end|>b<|vision_start|><|video_pad|><|vision_end|>c"
        "<|vision_start|>" + "<|image_pad|>" * 3 + "<|vision_end|>")
    with pytest.raises(BadImage, match="holds 2 <|image_pad|> tokens for 1 image"):
        expand_placeholders(text, [2], [1], QWEN25)


# ------------------------------------------------------------------------------ the spec


def write_vl_dir(path, model_type="qwen2_5_vl", pre=None, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    if pre is not None:
        (path / "preprocessor_config.json").write_text(pre if isinstance(pre, str) else json.dumps(pre))
    return path


def test_spec_from_model_dir(tmp_path, tokenizer):
    assert VisionSpec.from_model_dir(write_vl_dir(tmp_path / "text", "qwen2")) is None
    q3 = VisionSpec.from_model_dir(write_vl_dir(
        tmp_path / "q3", "qwen3_vl", pre={"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                                          "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
        vision_config={"patch_size": 16, "spatial_merge_size": 2}))
    assert (q3.patch_size, q3.factor, q3.image_mean, q3.supports_video) == (16, 32, (0.5,) * 3, False)
    with pytest.raises(ModelDirError, match="preprocessor_config.json: not found"):
        VisionSpec.from_model_dir(write_vl_dir(tmp_path / "nopre"))
    with pytest.raises(ModelDirError, match="preprocessor_config.json: cannot be read as JSON"):
        VisionSpec.from_model_dir(write_vl_dir(tmp_path / "badpre", pre="{oops"))
    with pytest.raises(ModelDirError, match="patch_size=14 but .* vision_config.patch_size=16"):
        VisionSpec.from_model_dir(write_vl_dir(tmp_path / "mismatch", pre={"patch_size": 14},
                                               vision_config={"patch_size": 16}))
    # the tokenizer must know the vision tokens with config.json's ids
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                           "<|vision_end|>")}
    ok = VisionSpec.from_model_dir(write_vl_dir(tmp_path / "ok", pre={}, image_token_id=ids["<|image_pad|>"],
                                                video_token_id=ids["<|video_pad|>"],
                                                vision_start_token_id=ids["<|vision_start|>"],
                                                vision_end_token_id=ids["<|vision_end|>"]))
    ok.check_tokenizer(tokenizer)
    bad = VisionSpec.from_model_dir(write_vl_dir(tmp_path / "ids", pre={}))  # transformers' default ids 151655...
    with pytest.raises(ModelDirError, match="maps <|vision_start|> to id .* but config.json says 151652"):
        bad.check_tokenizer(tokenizer)
