"""Which ``config.json`` model types are vision-language (VL) models, and what goes with one.

One place for the decision, read by the model-directory checks (:mod:`fitrl.models.check`),
``fitrl export`` and the Qwen-VL family (:mod:`fitrl.models.families.qwen_vl`): a VL model
loads with ``AutoModelForImageTextToText`` (transformers has no causal-LM class for these
types) and its directory carries the image processor's files besides the tokenizer.

Standard library only at import (the CLI builds its parser from modules that import this).
"""

from __future__ import annotations

from fitrl.core.model_types import VISION_LANGUAGE_TYPES  # noqa: F401  (the one table: fitrl/core/model_types.py)

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
"""The image processor's config (patch and merge size, mean/std, pixel budget): a VL directory needs it."""

PROCESSOR_FILES = (IMAGE_PROCESSOR_FILE, "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json", "chat_template.jinja")
"""Files of a VL model's processor, besides the tokenizer's (each optional but the first)."""


def is_vision_language(model_type: str) -> bool:
    """Whether ``model_type`` (``config.json``) is a vision-language model fitrl runs."""
    return model_type in VISION_LANGUAGE_TYPES


def auto_class_name(model_type: str) -> str:
    """The transformers auto class that builds the policy (next-token logits) of ``model_type``."""
    return "AutoModelForImageTextToText" if is_vision_language(model_type) else "AutoModelForCausalLM"
