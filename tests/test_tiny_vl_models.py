"""fitrl.models.tiny's vision-language archs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): built locally, they
load offline through the auto classes, their processor files give the real processors' numbers,
an image goes through forward and generate on CPU, and the model-directory checks accept them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
)

from fitrl.core.errors import ModelDirError  # noqa: E402
from fitrl.models import check  # noqa: E402
from fitrl.models.tiny import VISION_TOKENS, VL_ARCHS, describe, make_tiny_model, processor_configs  # noqa: E402
from fitrl.models.vl_types import VISION_LANGUAGE_TYPES, auto_class_name, is_vision_language  # noqa: E402

ARCHS = sorted(VL_ARCHS)
# arch -> (patch size, image mean, image std) of the real Qwen processors
REAL = {
    "qwen2_vl": (14, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
    "qwen2_5_vl": (14, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
    "qwen3_vl": (16, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
}


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vl")
    return {arch: make_tiny_model(root / arch, arch=arch, size="tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(vl_dirs):
    """arch -> (tokenizer, image processor, model), all loaded offline."""
    out = {}
    for arch, path in vl_dirs.items():
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        images = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
        out[arch] = (tok, images, model)
    return out


def picture(h: int = 64, w: int = 80, shift: int = 0):
    import numpy as np
    from PIL import Image

    return Image.fromarray(((np.arange(h * w * 3) + shift) % 251).astype(np.uint8).reshape(h, w, 3))


def image_prompt(tok, images, model, pic, question: str = "What is 1 + 1?"):
    """Model inputs for one user turn holding an image then ``question``, as the processor would
    make them: the image processor's patches, and the template's one ``<|image_pad|>`` expanded to
    one pad per merged patch (grid t*h*w / merge^2)."""
    mm = images(images=[pic], return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = int(mm["image_grid_thw"][0].prod()) // images.merge_size**2
    enc = tok([text.replace("<|image_pad|>", "<|image_pad|>" * n)], return_tensors="pt")
    ids = enc["input_ids"]
    token_types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    return dict(input_ids=ids, attention_mask=enc["attention_mask"], pixel_values=mm["pixel_values"],
                image_grid_thw=mm["image_grid_thw"], mm_token_type_ids=token_types), n


def test_vl_types_are_the_tiny_archs_and_import_light():
    assert VISION_LANGUAGE_TYPES == set(VL_ARCHS)
    assert is_vision_language("qwen2_5_vl") and not is_vision_language("qwen2")
    # the class fitrl export records (fitrl/checkpoint/export.py), a transformers class by that name
    assert getattr(transformers, auto_class_name("qwen3_vl")) is AutoModelForImageTextToText
    assert getattr(transformers, auto_class_name("llama")) is transformers.AutoModelForCausalLM
    code = "import sys, fitrl.models.vl_types; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_offline_with_consistent_config(arch, vl_dirs, loaded):
    tok, _, model = loaded[arch]
    cfg = model.config
    assert cfg.model_type == arch and type(model).__name__ == VL_ARCHS[arch].model_class
    assert model.dtype == torch.float32
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers) == (64, 2)
    assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)
    assert text.vocab_size == len(tok) and text.max_position_embeddings == 2048
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert head_dim == 16 and sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert vision.depth == 2 and vision.num_heads == 2 and vision.spatial_merge_size == 2
    assert vision.temporal_patch_size == 2 and vision.patch_size == REAL[arch][0]
    assert (vision.hidden_size if arch == "qwen2_vl" else vision.out_hidden_size) == text.hidden_size
    if arch == "qwen2_5_vl":
        assert vision.fullatt_block_indexes == [1] and vision.window_size // (2 * vision.patch_size) >= 1
    if arch == "qwen3_vl":
        assert text.rope_parameters["mrope_interleaved"] is True
        assert int(vision.num_position_embeddings**0.5) ** 2 == vision.num_position_embeddings
        assert vision.deepstack_visual_indexes == [0]
    # the vision token ids in the config are the tokenizer's
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    assert [getattr(cfg, n) for n in names] == tok.convert_tokens_to_ids(list(VISION_TOKENS))
    for t in VISION_TOKENS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] in tok.all_special_ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    gen = GenerationConfig.from_pretrained(vl_dirs[arch])
    assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_image_and_video_parts(arch, loaded):
    tok = loaded[arch][0]
    plain = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                          {"type": "video"}, {"type": "image", "image": "x.png"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
        "<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|><|im_end|>\n")
    convo = parts + [{"role": "assistant", "content": "two"}]
    out = tok.apply_chat_template(convo, return_assistant_tokens_mask=True, return_dict=True)
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "two<|im_end|>"


@pytest.mark.parametrize("arch", ARCHS)
def test_image_processor_has_the_real_numbers_without_torchvision(arch, vl_dirs, loaded):
    from transformers import Qwen2VLImageProcessorPil

    images = loaded[arch][1]
    patch, mean, std = REAL[arch]
    if not _has_torchvision():
        assert type(images) is Qwen2VLImageProcessorPil
    assert (images.patch_size, images.merge_size, images.temporal_patch_size) == (patch, 2, 2)
    assert list(images.image_mean) == mean and list(images.image_std) == std
    factor = patch * 2
    assert (images.size.shortest_edge, images.size.longest_edge) == (4 * factor**2, 64 * factor**2)
    saved = json.loads((vl_dirs[arch] / "preprocessor_config.json").read_text())
    assert saved == processor_configs(arch)["preprocessor_config.json"]
    assert ("min_pixels" in saved) == (arch != "qwen3_vl")  # as the real checkpoints state the pixel budget
    video = json.loads((vl_dirs[arch] / "video_preprocessor_config.json").read_text())
    assert video["patch_size"] == patch and video["video_processor_type"] == VL_ARCHS[arch].vision.video_processor
    # what a pipeline without AutoProcessor does: the PIL class straight from the file, same pixels
    direct = Qwen2VLImageProcessorPil(**saved)
    a, b = images(images=[picture()], return_tensors="pt"), direct(images=[picture()], return_tensors="pt")
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    # a 64x80 picture: rounded to the patch grid, one row of patches per `patch` pixels
    h, w = round(64 / factor) * factor, round(80 / factor) * factor
    assert a["image_grid_thw"].tolist() == [[1, h // patch, w // patch]]
    assert a["pixel_values"].shape == (h * w // patch**2, 3 * 2 * patch * patch)


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_processor(arch, vl_dirs):
    """transformers 5.23's Qwen-VL processors always build their video processor, a torchvision-only
    class: without torchvision AutoProcessor cannot load (image-only use included)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(vl_dirs[arch], local_files_only=True)
    except ImportError as e:
        assert not _has_torchvision() and "Torchvision" in str(e)
        pytest.skip("AutoProcessor needs torchvision (transformers 5.23): use AutoTokenizer + AutoImageProcessor")
    assert type(processor).__name__ == VL_ARCHS[arch].vision.processor_class
    assert processor.image_processor.patch_size == REAL[arch][0]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_generate_with_an_image(arch, loaded):
    tok, images, model = loaded[arch]
    inputs, n = image_prompt(tok, images, model, picture())
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == n > 0
    with torch.no_grad():
        logits = model(**inputs).logits
        other = model(**image_prompt(tok, images, model, picture(shift=100))[0]).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tok)) and torch.isfinite(logits).all()
    assert (logits[0, -1] - other[0, -1]).abs().max() > 1e-4  # the image reaches the last position
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 4)
    assert torch.equal(out[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])


@pytest.mark.parametrize("arch", ARCHS)
def test_same_arguments_same_bytes(arch, vl_dirs, tmp_path):
    again = make_tiny_model(tmp_path / "again", arch=arch, size="tiny", seed=0)
    files = sorted(p.name for p in vl_dirs[arch].iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (vl_dirs[arch] / name).read_bytes() == (again / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "seed1", arch=arch, size="tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_describe_reads_the_text_config(vl_dirs):
    info = describe(vl_dirs["qwen2_5_vl"])
    assert info["arch"] == "qwen2_5_vl" and info["vocab_size"] == 512
    assert (info["hidden_size"], info["num_layers"], info["num_heads"], info["num_kv_heads"]) == (64, 2, 4, 2)
    assert (info["vision_layers"], info["vision_hidden_size"], info["patch_size"]) == (2, 32, 14)
    assert info["size"] == "tiny" and 100_000 < info["params"] < 1_000_000
    assert describe(vl_dirs["qwen2_vl"])["vision_hidden_size"] == 32  # Qwen2-VL's embed_dim, not its output width


def test_unknown_sizes_and_archs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="valid sizes for qwen2_vl: tiny, small"):
        make_tiny_model(tmp_path / "m", arch="qwen2_vl", size="medium")
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        make_tiny_model(tmp_path / "m", arch="qwen4_vl")


@pytest.mark.parametrize("arch", ARCHS)
def test_model_dir_checks_accept_vl(arch, vl_dirs, tmp_path):
    from helpers import toy_config

    path = str(vl_dirs[arch])
    config = check.read_model_config(path)
    assert check.shape_value(config, "hidden_size") == 64
    check.check_model_type(config, path, "causal_lm")
    assert [f.name for f in check.check_weights(path, config)] == ["model.safetensors"]
    check.check_tokenizer(path, None, config, chat_template=True)
    assert check.check_image_processor(path, None, config).name == "preprocessor_config.json"
    tok = check.check_run_models(toy_config(path, tmp_path / "run"))  # what `fitrl train` runs first
    assert len(tok) == 512


def test_missing_image_processor_config_is_one_line(vl_dirs, tmp_path):
    from helpers import toy_config

    broken = tmp_path / "model"
    shutil.copytree(vl_dirs["qwen2_5_vl"], broken)
    (broken / "preprocessor_config.json").unlink()
    with pytest.raises(ModelDirError) as e:
        check.check_run_models(toy_config(broken, tmp_path / "run"))
    message = str(e.value)
    assert "\n" not in message and str(broken / "preprocessor_config.json") in message
    assert "vision-language" in message
    (broken / "preprocessor_config.json").write_text("{\n  \"patch_size\": 14,,\n}\n")
    with pytest.raises(ModelDirError, match="preprocessor_config.json:2: invalid JSON"):
        check.check_image_processor(str(broken), None, check.read_model_config(str(broken)))


def test_text_models_need_no_image_processor(tiny_model_dir):
    config = check.read_model_config(str(tiny_model_dir))
    assert check.check_image_processor(str(tiny_model_dir), None, config) is None


def test_embedding_check_reads_the_text_config(vl_dirs, tmp_path):
    wrong = tmp_path / "model"
    shutil.copytree(vl_dirs["qwen3_vl"], wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["text_config"]["vocab_size"] = 600
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match=r"vocab_size=600, hidden_size=64 but model.language_model.embed_tokens"):
        check.check_weights(str(wrong), check.read_model_config(str(wrong)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_small_size_builds_and_runs(arch, tmp_path):
    path = make_tiny_model(tmp_path / arch, arch=arch, size="small", seed=0)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    images = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, vision.depth) == (512, 8, 4)
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    inputs, _ = image_prompt(tok, images, model, picture(200, 300))
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_make_tiny_model_command(tmp_path, capsys):
    from fitrl.cli import main

    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "qwen3_vl"]) == 0
    out = capsys.readouterr().out
    assert "arch=qwen3_vl" in out and "vision_layers=2" in out and "patch_size=16" in out
    assert (tmp_path / "m" / "preprocessor_config.json").is_file()


# sha256 of model.safetensors of `make_tiny_model(arch=..., size="tiny", seed=0)`, as built before the
# head_dim option existed (transformers 5.19 and 5.23 alike; config.json is not pinned: it differs by version)
TINY_WEIGHTS_SHA256 = {
    "qwen2_vl": "cddfcc1f5e7035c551a8666872f6521579226398c159100b1c13c991ac41760b",
    "qwen2_5_vl": "b67d7aa17d8a74ab41532a7ff446d1516b1a4b4bc6100ac54312b9cd1b437dc0",
    "qwen3_vl": "2bf45363ebf95d6dd65768f5ba8f8d3874ffc0f4713b93ea4173743122b564d4",
}
# the default tiny decoder's multimodal rope sections (head_dim 16) and those at head_dim 32
MROPE = {"qwen2_vl": ([2, 3, 3], [4, 6, 6]), "qwen2_5_vl": ([2, 3, 3], [4, 6, 6]), "qwen3_vl": ([4, 2, 2], [6, 5, 5])}


@pytest.mark.parametrize("arch", ARCHS)
def test_default_tiny_weights_are_pinned(arch, vl_dirs, loaded):
    import hashlib

    path = vl_dirs[arch]
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == TINY_WEIGHTS_SHA256[arch]
    assert loaded[arch][2].config.text_config.rope_parameters["mrope_section"] == MROPE[arch][0]
    assert "head_dim" not in (path / "fitrl_tiny.json").read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_head_dim_resplits_the_heads_and_the_mrope(arch, vl_dirs, loaded, tmp_path):
    from safetensors.torch import load_file

    from fitrl.models.tiny import head_dims

    assert head_dims(arch, "tiny") == [8, 16, 32, 64]  # 2 and 4 leave an mrope section without a frequency
    path = make_tiny_model(tmp_path / "hd32", arch=arch, size="tiny", seed=0, head_dim=32)
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    text = model.config.text_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (64, 2, 1)
    assert model.model.language_model.layers[0].self_attn.head_dim == 32
    assert text.rope_parameters["mrope_section"] == MROPE[arch][1] and sum(MROPE[arch][1]) == 32 // 2
    if arch == "qwen3_vl":
        assert text.head_dim == 32
    assert model.config.vision_config.to_dict() == loaded[arch][2].config.vision_config.to_dict()  # tower unchanged
    # same shapes, same weights for the seed, but Qwen3-VL's per-head q/k norms (ones, of head_dim)
    new, old = load_file(str(path / "model.safetensors")), load_file(str(vl_dirs[arch] / "model.safetensors"))
    assert new.keys() == old.keys()
    norms = {k for k in new if k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert bool(norms) == (arch == "qwen3_vl")
    assert all(torch.equal(new[k], old[k]) for k in new.keys() - norms)
    assert all(new[k].shape == (32,) and torch.equal(new[k], torch.ones(32)) for k in norms)
    tok, images, _ = loaded[arch]
    inputs, _ = image_prompt(tok, images, model, picture())
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(tok)) and torch.isfinite(logits).all()
    assert describe(path)["head_dim"] == 32
    for name in ("preprocessor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (path / name).read_bytes() == (vl_dirs[arch] / name).read_bytes(), name


def test_head_dim_without_mrope_frequencies_is_refused(tmp_path):
    with pytest.raises(ValueError) as e:
        make_tiny_model(tmp_path / "m", arch="qwen3_vl", size="tiny", head_dim=4)
    assert str(e.value) == ("head_dim 4 is not possible for qwen3_vl size 'tiny' (hidden_size 64, head_dim 16): it must "
                            "be an even divisor of the hidden size whose mrope sections are all positive; "
                            "valid: 8, 16, 32, 64")
    assert not (tmp_path / "m").exists()
