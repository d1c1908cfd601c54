"""Tiny vision-language archs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for :func:`fitrl.models.tiny.make_tiny_model`:
the qwen2 ChatML tokenizer plus Qwen's four vision tokens, a text decoder of a ``SIZES`` row (under
``text_config``) with a multimodal rope, a tiny vision tower, and the processor files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitrl.models.tiny_specs import (_CHATML_TEMPLATE, _CONTENT, ARCHS, MAX_POSITION_EMBEDDINGS, ROPE_PARAMETERS,
                                     ArchSpec, TinyVisionArch)

# ---------------------------------------------------------------------------------------------
# Vision-language archs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the qwen2 ChatML tokenizer plus Qwen's
# four vision tokens, a text decoder of the size row above (under ``text_config``) with a
# multimodal rope, a tiny vision tower, and the processor files.
# ---------------------------------------------------------------------------------------------
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen's names (Qwen3-VL keeps them), in Qwen's id order; appended after the ChatML specials."""

# The vision tower per size; the text decoder is the SIZES row of the same name. Only these sizes
# exist for VL archs. ``num_position_embeddings`` (Qwen3-VL's learned position grid, a square).
VISION_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=2, hidden_size=32, intermediate_size=128, num_heads=2, num_position_embeddings=64),
    "small": dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, num_position_embeddings=256),
}

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2-VL and Qwen2.5-VL normalise with CLIP's
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # Qwen3-VL

# Image token budget of the tiny processors, in merged tokens (one per merge x merge patches):
# 4 (Qwen2-VL's own min_pixels, 56x56) to 64 (a 224x224 image at patch 14): a tiny model's
# prompt stays short on CPU. A real checkpoint allows up to 16384.
MIN_IMAGE_TOKENS = 4
MAX_IMAGE_TOKENS = 64

# Renders string content as _CONTENT does, and list content's image / video parts as Qwen's template does.
_VL_CONTENT = (
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
)
_CHATML_VL_TEMPLATE = _CHATML_TEMPLATE.replace(_CONTENT, _VL_CONTENT)


def _qwen2_vl_vision(v: dict[str, Any], hidden: int, layers: int) -> dict[str, Any]:
    # Qwen2-VL names the tower's width embed_dim and its merger's output (the text width) hidden_size
    return dict(depth=v["depth"], embed_dim=v["hidden_size"], hidden_size=hidden, num_heads=v["num_heads"],
                mlp_ratio=v["intermediate_size"] // v["hidden_size"])


def _qwen2_5_vl_vision(v: dict[str, Any], hidden: int, layers: int) -> dict[str, Any]:
    # window attention in every block but the odd ones (the real 32-block tower: full at 7, 15, 23, 31);
    # window_size 112 px = 4 merged tokens at patch 14, as in the real config
    return dict(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                num_heads=v["num_heads"], out_hidden_size=hidden, window_size=112,
                fullatt_block_indexes=[i for i in range(v["depth"]) if i % 2 == 1])


def _qwen3_vl_vision(v: dict[str, Any], hidden: int, layers: int) -> dict[str, Any]:
    # deepstack: features of every block but the last feed the first decoder layers (the real
    # 27-block tower takes 8, 16, 24 into decoder layers 0-2); at most one per decoder layer
    deepstack = list(range(v["depth"] - 1))[:layers]
    return dict(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                num_heads=v["num_heads"], out_hidden_size=hidden, num_position_embeddings=v["num_position_embeddings"],
                deepstack_visual_indexes=deepstack)


def _mrope_qwen2(half: int) -> list[int]:
    """Qwen2-VL's split (16, 24, 24) of 64 frequencies, scaled: a quarter temporal, the rest halved."""
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def _mrope_qwen3(half: int) -> list[int]:
    """Qwen3-VL's interleaved (24, 20, 20) of 64 frequencies, scaled: 5/16 each to height and width."""
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def _vl_arch(config_class: str, model_class: str, vision: TinyVisionArch) -> ArchSpec:
    qwen2 = ARCHS["qwen2"]
    return ArchSpec(
        config_class=config_class,
        model_class=model_class,
        special_tokens=qwen2.special_tokens + VISION_TOKENS,
        bos=qwen2.bos,
        eos=qwen2.eos,
        pad=qwen2.pad,
        chat_template=_CHATML_VL_TEMPLATE,
        add_bos=qwen2.add_bos,
        pretokenizer=qwen2.pretokenizer,
        tokenizer_class=qwen2.tokenizer_class,  # AutoTokenizer loads Qwen2Tokenizer for all three
        vision=vision,
    )


VL_ARCHS: dict[str, ArchSpec] = {
    "qwen2_vl": _vl_arch("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", TinyVisionArch(
        processor_class="Qwen2VLProcessor", video_processor="Qwen2VLVideoProcessor", patch_size=14,
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, size_keys="pixels",
        vision_config=_qwen2_vl_vision, mrope_section=_mrope_qwen2)),
    "qwen2_5_vl": _vl_arch("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TinyVisionArch(
        processor_class="Qwen2_5_VLProcessor", video_processor="Qwen2VLVideoProcessor", patch_size=14,
        image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, size_keys="pixels",
        vision_config=_qwen2_5_vl_vision, mrope_section=_mrope_qwen2)),
    "qwen3_vl": _vl_arch("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TinyVisionArch(
        processor_class="Qwen3VLProcessor", video_processor="Qwen3VLVideoProcessor", patch_size=16,
        image_mean=HALF, image_std=HALF, size_keys="size",
        vision_config=_qwen3_vl_vision, mrope_section=_mrope_qwen3, rope_extra={"mrope_interleaved": True},
        states_head_dim=True)),
}
"""Vision-language archs: ``model_type`` -> spec. Loaded with ``AutoModelForImageTextToText``."""



def _vl_config(spec: ArchSpec, size: str, size_cfg: dict[str, Any], tokenizer, bos_id, eos_id, pad_id):
    """The composite config of a VL arch: the size row's decoder under ``text_config`` (with a
    multimodal rope whose sections sum to head_dim // 2), the vision tower of ``VISION_SIZES``,
    and the vision token ids read from ``tokenizer``."""
    import transformers

    vision = spec.vision
    tie = size_cfg.pop("tie_word_embeddings")
    head_dim = size_cfg["hidden_size"] // size_cfg["num_attention_heads"]
    rope = dict(ROPE_PARAMETERS, mrope_section=vision.mrope_section(head_dim // 2), **vision.rope_extra)
    text = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_parameters=rope,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **size_cfg,
    )
    if vision.states_head_dim:
        text["head_dim"] = head_dim
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    return getattr(transformers, spec.config_class)(
        text_config=text,
        vision_config=dict(vision.vision_config(VISION_SIZES[size], text["hidden_size"], text["num_hidden_layers"]),
                           patch_size=vision.patch_size, spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=tie,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **ids,
    )


def processor_configs(arch: str) -> dict[str, dict[str, Any]]:
    """The processor files of VL arch ``arch`` (file name -> JSON), as the real checkpoints state
    them, with the tiny image-token budget (``MIN_IMAGE_TOKENS``..``MAX_IMAGE_TOKENS``):

    - ``preprocessor_config.json``, the image processor. Qwen2/2.5-VL give the pixel budget as
      ``min_pixels``/``max_pixels``, Qwen3-VL as ``size`` ``{shortest_edge, longest_edge}``;
      transformers 5 reads both as ``size`` (pixels, not edges). ``image_processor_type`` is the
      real checkpoints' ``Qwen2VLImageProcessor``: ``AutoImageProcessor`` maps it to
      ``Qwen2VLImageProcessorPil`` when torchvision is missing.
    - ``video_preprocessor_config.json``, the video processor (torchvision-only in transformers
      5.23, so written as JSON, never built here).
    """
    vision = VL_ARCHS[arch].vision
    factor = vision.patch_size * 2  # one merged token covers (patch * merge)^2 pixels
    budget = {"shortest_edge": MIN_IMAGE_TOKENS * factor**2, "longest_edge": MAX_IMAGE_TOKENS * factor**2}
    common: dict[str, Any] = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(vision.image_mean),
        "image_std": list(vision.image_std),
        "merge_size": 2,
        "patch_size": vision.patch_size,
        "processor_class": vision.processor_class,
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
    }
    image = dict(common, image_processor_type="Qwen2VLImageProcessor")
    if vision.size_keys == "pixels":
        image.update(min_pixels=budget["shortest_edge"], max_pixels=budget["longest_edge"])
    else:
        image["size"] = budget
    video = dict(common, size=budget, video_processor_type=vision.video_processor)
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def _write_processor(out: Path, arch: str) -> None:
    """The processor files (:func:`processor_configs`), keys sorted: byte-stable. The chat
    template is the tokenizer's chat_template.jinja, which a processor reads too."""
    for name, cfg in processor_configs(arch).items():
        (out / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
