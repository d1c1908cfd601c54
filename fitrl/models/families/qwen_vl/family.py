"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision tower whose patch embeddings replace the image
(and video) pad tokens of the prompt, and a multimodal rotary position (docs/vision.md).

What differs from a text model, and where it is handled:

- **Positions** are (3, B, T) (temporal, height, width) from the backbone's ``get_rope_index``,
  which for Qwen2-VL and Qwen2.5-VL is replaced by :func:`fitrl.models.families.qwen_vl.mrope.rope_index`
  (the released models' layout after a video, which transformers 5.x departs from; Qwen3-VL keeps
  transformers'), called once per rollout on the whole prompt+response; the batch carries them
  as (B, 3, T) so that every tensor's first dimension is the batch, and the same tensor feeds
  generation's successors: log-prob recompute, the reference and the critic. During ``generate``
  transformers computes the same positions itself from the prompt (tested equal, fp32 log-probs
  within 1e-5).
- **Extra inputs**: each prompt's processed images travel as one per-sample field,
  ``multi_modal_inputs`` (a dict of ``pixel_values`` (patches, C*t*p*p), ``image_grid_thw`` (k, 3)
  and the video counterparts, or None for a text-only prompt, made by :mod:`.media`);
  a micro-batch's forward concatenates its samples' dicts in batch order, which is the order in
  which the model matches image features to image pad tokens.
- **Sharding**: every vision block and every decoder layer is its own FSDP unit.
- **The value model** (critic) is the multimodal backbone with a one-output linear head
  (transformers has no token-classification class for these models).
- ``actor.model.freeze_vision_tower`` turns off gradients for the vision tower and its merger,
  so the optimizer holds no state for them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from fitrl.config.schema import ModelConfig
from fitrl.core.padding import position_ids_from_mask
from fitrl.models.decoder import DecoderLayout
from fitrl.models.families.base import HEADS, MODEL_FAMILIES, Builder, ModelFamily, ModelInputs, auto_builders
from fitrl.models.families.causal_lm import CAUSAL_LM
from fitrl.models.families.qwen_vl.mrope import rope_index
from fitrl.models.families.qwen_vl.media import VisionSpec
from fitrl.models.families.qwen_vl.tower import VisionShape, tower_from_config
from fitrl.models.vl_types import VISION_LANGUAGE_TYPES


MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""Keys of a prompt's ``multi_modal_inputs`` dict; concatenated along dim 0 across a micro-batch."""


def backbone(model: nn.Module) -> nn.Module:
    """The ``Qwen*VLModel`` inside a policy (``*ForConditionalGeneration``) or a value model:
    it holds ``visual``, ``language_model`` and ``get_rope_index``."""
    inner = getattr(model, "model", model)
    inner = getattr(inner, "base_model", inner) if not hasattr(inner, "visual") else inner  # PEFT wrapper
    if not hasattr(inner, "visual"):
        inner = next((m for m in model.modules() if hasattr(m, "visual") and hasattr(m, "language_model")), None)
    if inner is None:
        raise ValueError(f"{type(model).__name__} has no vision-language backbone (no .visual / .language_model)")
    return inner


GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""What positions need: the grids (and time scale), not the pixels."""


def concat_multi_modal(per_sample: Optional[list], device: torch.device,
                       keys: tuple[str, ...] = MM_KEYS) -> dict[str, torch.Tensor]:
    """One forward's image inputs from its samples' ``multi_modal_inputs`` (None entries are
    text-only prompts), concatenated in batch order; ``keys``: which of them."""
    if not per_sample:
        return {}
    parts: dict[str, list[torch.Tensor]] = {}
    for mm in per_sample:
        for key in keys:
            if mm is not None and mm.get(key) is not None:
                parts.setdefault(key, []).append(torch.as_tensor(mm[key]))
    return {k: torch.cat(v).to(device) for k, v in parts.items()}


class QwenVLInputs(ModelInputs):
    """Positions and image inputs for one Qwen-VL model instance (its config fixes the token ids,
    merge size and, for videos, the time scale)."""

    def __init__(self, model: nn.Module):
        inner = backbone(use_released_positions(model))
        self._rope_index = inner.get_rope_index  # reads only the config: no parameters, no collective
        config = inner.config
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.never_generate = tuple(int(i) for i in (config.image_token_id, config.video_token_id,
                                                      getattr(config, "vision_start_token_id", None),
                                                      getattr(config, "vision_end_token_id", None)) if i is not None)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) int: 1 on image pad tokens, 2 on video pad tokens, 0 elsewhere (what
        transformers' ``get_rope_index`` groups positions by)."""
        return ((input_ids == self.image_token_id).int() + 2 * (input_ids == self.video_token_id).int())

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  batch: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        # the grids only: concatenating the pixel values too would copy every sequence's (the
        # whole rollout's, n per prompt: 16 x 100 MB for 8 prompts x 2 of 2048 x 2048 pictures)
        # for nothing (bench/vl_image_memory.py)
        mm = concat_multi_modal(_field(batch), input_ids.device, GRID_KEYS)
        if "image_grid_thw" not in mm and "video_grid_thw" not in mm:
            # text-only: the three rope axes all count real tokens
            return position_ids_from_mask(attention_mask)[:, None, :].expand(-1, 3, -1).contiguous()
        pos, _ = self._rope_index(input_ids, mm_token_type_ids=self.token_types(input_ids),
                                  image_grid_thw=mm.get("image_grid_thw"), video_grid_thw=mm.get("video_grid_thw"),
                                  second_per_grid_ts=mm.get("second_per_grid_ts"), attention_mask=attention_mask)
        return pos.permute(1, 0, 2).contiguous()  # (3, B, T) -> (B, 3, T)

    def extra(self, batch: Optional[Mapping[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        return concat_multi_modal(_field(batch), device)

    def generate_extra(self, input_ids: torch.Tensor, batch: Optional[Mapping[str, Any]],
                       device: torch.device) -> dict[str, torch.Tensor]:
        extra = self.extra(batch, device)
        if extra:
            extra["mm_token_type_ids"] = self.token_types(input_ids)
        return extra


RELEASED_POSITIONS = ("qwen2_vl", "qwen2_5_vl")
"""Families whose positions come from :mod:`fitrl.models.families.mrope` (Qwen3-VL's videos are
split into timestamped frames, which fitrl does not take: its images keep transformers' code)."""


def use_released_positions(model: nn.Module) -> nn.Module:
    """Make the backbone's ``get_rope_index`` (which both the trainer's positions and Hugging Face
    ``generate`` call) :func:`~fitrl.models.families.mrope.rope_index`, on this instance only."""
    inner = backbone(model)
    config = inner.config
    if config.model_type not in RELEASED_POSITIONS or getattr(inner.get_rope_index, "_fitrl", False):
        return model
    merge = int(config.vision_config.spatial_merge_size)
    per_second = getattr(config.vision_config, "tokens_per_second", None) if config.model_type == "qwen2_5_vl" else None
    image_id, video_id = int(config.image_token_id), int(config.video_token_id)

    def released(input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                 second_per_grid_ts=None, attention_mask=None, **_):
        types = (mm_token_type_ids if mm_token_type_ids is not None
                 else (input_ids == image_id).int() + 2 * (input_ids == video_id).int())
        return rope_index(types, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts, merge=merge,
                          tokens_per_second=per_second)

    released._fitrl = True
    inner.get_rope_index = released
    return model


def _field(batch: Optional[Mapping[str, Any]]) -> Optional[list]:
    if batch is None or "multi_modal_inputs" not in batch:
        return None
    return batch["multi_modal_inputs"]


class QwenVLFamily(ModelFamily):
    name = "qwen_vl"
    model_types = VISION_LANGUAGE_TYPES

    def builders(self, head: str, model: ModelConfig) -> tuple[Builder, Builder]:
        if head == "causal_lm":
            load, build = auto_builders("AutoModelForImageTextToText", model)
        elif head == "value":
            load, build = _value_builders(model)
        else:
            raise ValueError(f"unknown model head {head!r}; valid: {', '.join(HEADS)}")
        if not model.freeze_vision_tower:
            return load, build
        return (lambda: freeze_vision_tower(load())), (lambda: freeze_vision_tower(build()))

    def blocks_to_shard(self, model: nn.Module) -> list[nn.Module]:
        inner = backbone(model)
        return [*inner.visual.blocks, *inner.language_model.layers]

    def inputs_for(self, model: nn.Module) -> ModelInputs:
        return QwenVLInputs(model)

    def decoder_layout(self, model_type: str) -> Optional[DecoderLayout]:
        # the language model is its text family's decoder (qwen2_5_vl's is Qwen2's, under text_config)
        return CAUSAL_LM.decoder_layout(model_type)

    def vision_tower(self, config: dict[str, Any]) -> VisionShape:
        return tower_from_config(config)

    def media_spec(self, model_path: str | Path) -> Optional[VisionSpec]:
        return VisionSpec.from_model_dir(model_path)


def freeze_vision_tower(model: nn.Module) -> nn.Module:
    """No gradient (so no optimizer state) for the vision encoder and its patch merger."""
    backbone(model).visual.requires_grad_(False)
    return model


QWEN_VL = QwenVLFamily()
MODEL_FAMILIES.add(QWEN_VL.name, QWEN_VL)


class QwenVLValueModel(nn.Module):
    """The critic: the multimodal backbone (vision tower + decoder, no lm_head) and a one-output
    linear ``score`` head on the last hidden states; ``forward(...).logits`` is (B, T, 1) as a
    token-classification model's."""

    def __init__(self, inner: nn.Module, hidden_size: int):
        super().__init__()
        self.model = inner
        self.config = inner.config
        self.score = nn.Linear(hidden_size, 1, bias=False, dtype=next(inner.parameters()).dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=False, **mm):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, **mm).last_hidden_state  # (B, T, H)
        return SimpleNamespace(logits=self.score(hidden))

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def _value_builders(model: ModelConfig) -> tuple[Builder, Builder]:
    load, build = auto_builders("AutoModelForImageTextToText", model)

    def wrap(policy: nn.Module) -> nn.Module:
        # the score head starts random (seeded by the critic worker), as a token-classification head would
        inner = backbone(policy)
        return QwenVLValueModel(inner, inner.config.text_config.hidden_size)
    return (lambda: wrap(load())), (lambda: wrap(build()))
