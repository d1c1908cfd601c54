"""Model families: how fitrl builds, shards and feeds each architecture (see :mod:`.base`).

``family_for(model_path)`` picks the family from the checkpoint's ``config.json``
``model_type``: the family that claims that type, else ``causal_lm`` (every text model).
A new family is a module (or, for a vision-language family, a folder such as ``qwen_vl/``: its
builders, its tower's tensors and FLOPs, its media processing) that subclasses
:class:`ModelFamily`, adds itself to :data:`MODEL_FAMILIES` and is imported below.
"""

from __future__ import annotations

from pathlib import Path

from fitrl.models.config_json import read_config_json
from fitrl.data.media import MediaSpec
from fitrl.models.families.base import DTYPES, HEADS, MODEL_FAMILIES, TEXT_INPUTS, ModelFamily, ModelInputs
from fitrl.models.families.causal_lm import CAUSAL_LM, CausalLMFamily
from fitrl.models.families.qwen_vl import QWEN_VL, QwenVLFamily
from fitrl.models.vl_types import VISION_LANGUAGE_TYPES

__all__ = ["CAUSAL_LM", "DTYPES", "HEADS", "MODEL_FAMILIES", "QWEN_VL", "TEXT_INPUTS", "VISION_LANGUAGE_TYPES",
           "CausalLMFamily", "ModelFamily", "ModelInputs", "QwenVLFamily", "family_for", "family_of_type",
           "media_spec_of", "model_type"]


def model_type(model_path: str | Path) -> str:
    """``model_type`` from a local checkpoint's ``config.json`` ("" when it has none)."""
    return str(read_config_json(model_path, what="model path").get("model_type", ""))


def family_for(model_path: str | Path, name: str = "auto") -> ModelFamily:
    """The family of the checkpoint at ``model_path``; ``name`` other than ``auto`` picks one
    explicitly (an unknown name is a :class:`ConfigError` listing the valid ones)."""
    if name != "auto":
        return MODEL_FAMILIES.get(name)
    return family_of_type(model_type(model_path))


def media_spec_of(model_path: str | Path) -> "MediaSpec | None":
    """How the data path and the engines feed images to the model at ``model_path``: its family's
    media spec (:class:`fitrl.data.media.MediaSpec`), None for a text model."""
    return family_for(model_path).media_spec(model_path)


def family_of_type(kind: str) -> ModelFamily:
    """The family that claims ``config.json``'s ``model_type`` ``kind``; ``causal_lm`` for the others."""
    for family_name in MODEL_FAMILIES:
        family = MODEL_FAMILIES.get(family_name)
        if kind in family.model_types:
            return family
    return CAUSAL_LM
