"""PromptDataset with images and videos: image tokens expanded and counted, references kept
(never pixels), image directories and embedded bytes, videos, the text-model refusal, every
bad-image row in both ``data.on_bad_image`` modes, and a real tiny Qwen2.5-VL directory."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from fitrl.config.data import DataConfig
from fitrl.core.errors import DataError
from fitrl.data.dataset import PromptDataset
from fitrl.models.families.qwen_vl.media import VisionSpec, process_images
from vision_helpers import CHATML, MARK, QWEN2, QWEN3, QWEN25, encode, gif_animated, png_header, rgb, tokenizer  # noqa: F401 (fixture)

# ------------------------------------------------------------------------------ the dataset


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_ds(files, tokenizer, spec=QWEN25, **opts):
    kw = {k: opts.pop(k) for k in list(opts) if k in ("max_prompt_length", "name")}
    media = DataConfig(min_pixels=3136, max_pixels=28 * 28 * 16, **opts)
    return PromptDataset([str(f) for f in (files if isinstance(files, list) else [files])], tokenizer,
                         prompt_key="prompt", answer_key="answer", max_prompt_length=kw.get("max_prompt_length", 4096),
                         name=kw.get("name", "train"), vision=spec, media=media)


def test_dataset_expands_image_tokens_and_keeps_references(tmp_path, tokenizer):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(encode(rgb(100, 200)))   # -> 56x140: 10 tokens
    (tmp_path / "imgs" / "b.png").write_bytes(encode(rgb(224, 224)))   # -> 112x112 within 12544: 16 tokens
    data = write_rows(tmp_path / "d.jsonl", [
        {"prompt": "<image> What is in the image?", "answer": "x", "images": ["imgs/a.png"]},
        {"prompt": "Describe the picture.", "answer": "y", "images": ["imgs/a.png", "imgs/b.png"]},  # no placeholder
        {"prompt": "What is 1?", "answer": "1", "images": None},
        {"prompt": "What is 2?", "answer": "2"},
    ])
    ds = make_ds(data, tokenizer)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(ds) == 4 and ds.has_vision
    assert ds[0]["prompt_ids"].count(pad) == 10
    assert ds[0]["prompt_text"] == f"<|im_start|>user\n{MARK} What is in the image?<|im_end|>\n<|im_start|>assistant\n"
    assert ds[1]["prompt_ids"].count(pad) == 10 + 16
    assert ds[1]["prompt_text"].startswith(f"<|im_start|>user\n{MARK}{MARK}Describe")  # prepended, in order
    assert ds[0]["images"] == [str(tmp_path / "imgs" / "a.png")] and ds[0]["image_sizes"] == [(56, 140)]
    assert "images" not in ds[0]["extra"]
    # the resized sizes multi_modal_inputs checks the grids against, per prompt (none for the text rows)
    assert [ds[i].get("image_sizes", []) for i in range(4)] == [[(56, 140)], [(56, 140), (112, 112)], [], []]
    # the ids are the tokenised text with each image's pad repeated once per token
    expanded = ds[0]["prompt_text"].replace("<|image_pad|>", "<|image_pad|>" * 10)
    assert ds[0]["prompt_ids"] == tokenizer(expanded, add_special_tokens=False)["input_ids"]

    mm = ds.multi_modal_inputs(1)
    assert mm["image_grid_thw"].tolist() == [[1, 4, 10], [1, 8, 8]]
    assert mm["pixel_values"].shape == (40 + 64, 3 * 2 * 14 * 14)
    ref = process_images([rgb(100, 200), rgb(224, 224)], QWEN25, 3136, 28 * 28 * 16)
    assert torch.equal(mm["pixel_values"], ref["pixel_values"])
    assert ds.multi_modal_inputs(2) is None and ds.multi_modal_inputs(3) is None
    assert "4 prompts" in ds.summary() and "3 images/videos in 2 prompts" in ds.summary()

    # an image replaced after start-up: the row is named, not a shape error in the model
    (tmp_path / "imgs" / "b.png").write_bytes(encode(rgb(500, 300)))
    with pytest.raises(DataError, match=f"{data}:2: an image of this row changed size since start-up"):
        ds.multi_modal_inputs(1)
    (tmp_path / "imgs" / "b.png").write_bytes(b"garbage")
    with pytest.raises(DataError, match=f"{data}:2: an image of this row cannot be read any more"):
        ds.multi_modal_inputs(1)


def test_max_prompt_length_counts_image_tokens(tmp_path, tokenizer):
    (tmp_path / "a.png").write_bytes(encode(rgb(100, 200)))
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "<image> What?", "answer": "x", "images": ["a.png"]},
                                             {"prompt": "What?", "answer": "x"}])
    long_ = len(make_ds(data, tokenizer)[0]["prompt_ids"])
    short = len(make_ds(data, tokenizer)[1]["prompt_ids"])
    assert long_ >= short + 10
    ds = make_ds(data, tokenizer, max_prompt_length=long_ - 1)
    assert len(ds) == 1 and ds.num_filtered == 1 and ds[0]["extra"] == {}


def test_image_dir_and_embedded_images(tmp_path, tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(encode(rgb(100, 200)))
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "<image>", "answer": "x", "images": "a.png"}])
    assert make_ds(data, tokenizer, image_dir=str(tmp_path / "pics"))[0]["images"] == [str(tmp_path / "pics" / "a.png")]
    # parquet with the datasets Image struct, and a save_to_disk directory with an Image feature: bytes kept
    png = encode(rgb(100, 200))
    pq.write_table(pa.Table.from_pylist([{"prompt": "<image>", "answer": "x",
                                          "images": [{"bytes": png, "path": "a.png"}]}]), tmp_path / "d.parquet")
    ds = make_ds(tmp_path / "d.parquet", tokenizer)
    assert ds[0]["images"] == [png] and ds[0]["image_sizes"] == [(56, 140)]
    saved = tmp_path / "saved"
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image())})
    datasets.Dataset.from_list([{"prompt": "<image>", "answer": "x", "images": [rgb(100, 200)]}],
                               features=features).save_to_disk(str(saved))
    ds = make_ds(saved, tokenizer)
    assert isinstance(ds[0]["images"][0], bytes) and ds[0]["image_sizes"] == [(56, 140)]
    assert ds.multi_modal_inputs(0)["image_grid_thw"].tolist() == [[1, 4, 10]]


def test_videos_in_the_dataset(tmp_path, tokenizer):
    for i in range(5):
        (tmp_path / f"f{i}.png").write_bytes(encode(rgb(56, 84, i)))
    frames = [f"f{i}.png" for i in range(5)]
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "<video> What happens?", "answer": "x", "videos": [frames]}])
    ds = make_ds(data, tokenizer, max_frames=4, video_max_pixels=56 * 84)
    # 5 frames -> sampled to 4 (0, 1, 2, 3) -> grid_t 2; 56x84 -> 4x6 patches: 2 * 24 / 4 = 12 tokens
    assert ds[0]["prompt_ids"].count(tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 12
    assert ds[0]["video_sizes"] == [(4, 56, 84)]
    mm = ds.multi_modal_inputs(0)
    assert mm["video_grid_thw"].tolist() == [[2, 4, 6]] and "pixel_values" not in mm
    assert mm["pixel_values_videos"].shape == (48, 3 * 2 * 14 * 14)
    assert mm["second_per_grid_ts"].tolist() == [1.0]  # 2 frames per temporal patch at data.video_fps=2
    with pytest.raises(DataError, match=rf"{data}:1: videos are not supported for qwen3_vl yet"):
        make_ds(data, tokenizer, spec=QWEN3)


def test_text_model_refuses_rows_with_images(tmp_path, tokenizer):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "x", "images": []},
                                             {"prompt": "q", "answer": "x", "images": ["a.png"]}])
    with pytest.raises(DataError, match=rf"{data}:2: row has images \(column 'images'\) but actor.model.path is a "
                                        r"text model; use a vision-language model or drop the 'images' column"):
        PromptDataset([str(data)], tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=512)
    # another column name is just an extra column
    ds = PromptDataset([str(data)], tokenizer, prompt_key="prompt", answer_key="answer", max_prompt_length=512,
                       media=DataConfig(image_key="pictures"))
    assert ds[1]["extra"] == {"images": ["a.png"]}


def bad_rows(tmp_path):
    """Each bad case as (row, expected reason, kind), with the files it needs written."""
    files = {
        "ok.png": encode(rgb(100, 200)),
        "corrupt.png": b"this is not an image",
        "trunc.png": encode(rgb(64, 64))[:3000],
        "trunc.jpg": encode(rgb(64, 64), "JPEG")[:1000],
        "empty.png": b"",
        "zero.png": png_header(0, 10),
        "anim.gif": gif_animated(),
        "huge.png": png_header(100000, 100000),
        "long.png": png_header(20000, 16),
        "thin.png": encode(rgb(1, 300)),
        "cmyk.jpg": encode(Image.new("CMYK", (40, 40), (0, 255, 0, 0)), "JPEG"),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return [
        ({"images": ["ok.png", "missing.png"]}, r"image 2 of 2 \(missing.png\): file not found", "missing file"),
        ({"images": ["corrupt.png"]}, r"image 1 of 1 \(corrupt.png\): not an image or corrupt", "not an image"),
        ({"images": ["trunc.png"]}, r"image 1 of 1 \(trunc.png\): truncated file", "truncated"),
        ({"images": ["trunc.jpg"]}, r"image 1 of 1 \(trunc.jpg\): truncated file", "truncated"),
        ({"images": ["empty.png"]}, r"image 1 of 1 \(empty.png\): empty file \(0 bytes\)", "empty file"),
        ({"images": ["zero.png"]}, r"image 1 of 1 \(zero.png\): zero-size image \(0x10\)", "zero size"),
        ({"images": ["anim.gif"]}, r"animated image \(3 frames\); use a video column for frames", "animated"),
        ({"images": ["huge.png"]}, r"image 1 of 1 \(huge.png\): too many pixels to decode safely", "too large"),
        ({"images": ["long.png"]}, r"image is 20000x16, a side over data.max_image_side=16384", "too large"),
        ({"images": ["thin.png"]}, r"image is 300x1: aspect ratio over 200", "aspect ratio"),
        ({"images": ["ok.png"] * 5}, r"row has 5 images, more than data.limit_images=4", "too many images"),
        ({"images": ["ok.png"], "prompt": "<image> and <image>"}, "2 <image> placeholders but 1 image",
         "placeholder mismatch"),
        ({"images": [], "prompt": "<image> what?"}, "1 <image> placeholder but 0 images", "placeholder mismatch"),
        ({"images": [{"bytes": None, "path": None}]}, "image value has neither bytes nor path", "not an image"),
    ]


def test_every_bad_image_stops_naming_file_row_and_image(tmp_path, tokenizer):
    for case, (extra, reason, _) in enumerate(bad_rows(tmp_path)):
        good = {"prompt": "What?", "answer": "x", "images": ["ok.png"]}
        data = write_rows(tmp_path / f"d{case}.jsonl", [good, {"prompt": "What?", "answer": "x", **extra}])
        with pytest.raises(DataError) as e:
            make_ds(data, tokenizer)
        msg = str(e.value)
        assert msg.startswith(f"{data}:2: ") and msg.endswith(
            "; fix or remove the row, or set data.on_bad_image=skip"), msg
        assert __import__("re").search(reason, msg), (reason, msg)


def test_skip_drops_bad_rows_and_counts_them(tmp_path, tokenizer):
    cases = bad_rows(tmp_path)
    rows = [{"prompt": "What?", "answer": "x", **extra} for extra, _, _ in cases]
    rows += [{"prompt": "What?", "answer": "ok", "images": ["ok.png"]}, {"prompt": "Plain", "answer": "ok"},
             {"prompt": "What?", "answer": "ok", "images": ["cmyk.jpg"]}]  # CMYK is fine
    data = write_rows(tmp_path / "d.jsonl", rows)
    ds = make_ds(data, tokenizer, on_bad_image="skip")
    assert len(ds) == 3 and ds.num_rows == len(rows) and ds.num_filtered == 0
    assert [ex["answer"] for ex in (ds[i] for i in range(3))] == ["ok"] * 3
    kinds = {}
    for _, _, kind in cases:
        kinds[kind] = kinds.get(kind, 0) + 1
    assert dict(ds.bad_image_counts) == kinds
    summary = ds.summary()
    assert f"({len(cases)} rows with bad images skipped: " in summary
    assert "2 truncated" in summary and "1 missing file" in summary and "2 placeholder mismatch" in summary

    # every row bad: one error that says so
    data = write_rows(tmp_path / "all_bad.jsonl", rows[:3])
    with pytest.raises(DataError, match=r"every row of .* has a bad image and was skipped \(1 missing file, "
                                        r"1 not an image, 1 truncated\)"):
        make_ds(data, tokenizer, on_bad_image="skip")


def test_with_a_tiny_vl_model_dir(tmp_path):
    """The real path: a tiny Qwen2.5-VL directory's spec and tokenizer, and its model accepting the
    prompt ids and pixels (the vision tower's features must match the image tokens one for one)."""
    import transformers

    from fitrl.models.tiny import make_tiny_model

    try:
        model_dir = make_tiny_model(tmp_path / "m", arch="qwen2_5_vl")
    except ValueError as e:
        pytest.skip(f"no tiny qwen2_5_vl model yet: {e}")
    spec = VisionSpec.from_model_dir(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    spec.check_tokenizer(tok)
    (tmp_path / "a.png").write_bytes(encode(rgb(100, 200)))
    for i in range(3):
        (tmp_path / f"f{i}.png").write_bytes(encode(rgb(60, 90, i)))
    data = write_rows(tmp_path / "d.jsonl", [
        {"prompt": "<image> What is 1 + 2?", "answer": "3", "images": ["a.png"]},
        {"prompt": "<video> then <image>?", "answer": "3", "images": ["a.png"],
         "videos": [["f0.png", "f1.png", "f2.png"]]},
    ])
    ds = make_ds(data, tok, spec=spec, video_max_pixels=28 * 28 * 8)
    image_pad, video_pad = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")
    assert ds[0]["prompt_ids"].count(image_pad) == 10
    # 3 frames -> 4 (padded) -> grid_t 2; 60x90 -> 56x84 (4x6 patches): 2 * 24 / 4 = 12 tokens
    assert ds[1]["prompt_ids"].count(video_pad) == 12
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    for i in range(len(ds)):
        ids = torch.tensor([ds[i]["prompt_ids"]])
        # the processor's mm_token_type_ids: 1 on image tokens, 2 on video tokens
        types = (ids == image_pad).long() + 2 * (ids == video_pad).long()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                        **ds.multi_modal_inputs(i))
        assert out.logits.shape[:2] == ids.shape and torch.isfinite(out.logits).all()
