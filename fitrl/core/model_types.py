"""Every ``config.json`` ``model_type`` fitrl runs, in one table: its decoder family, its decoder's
kind (dense or mixture of experts) and whether it is a vision-language model (and takes videos).

The model-directory checks, the loaders, the model shape (memory plan and FLOPs) all read this
table: a new text model type is one row here; a new vision-language family its rows here plus its
own folder (fitrl/models/families/, docs/architecture.md). The family that claims a row describes
its decoder (``ModelFamily.decoder_layout``, of the row's ``kind``: fitrl/models/decoder.py).
``tests/test_model_types.py`` and ``tests/test_extension_points.py`` check each reader knows every
row. Standard library only: the CLI builds its parser from modules that import this.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODER_KINDS = ("dense", "moe")
"""A decoder's layer kind: ``dense`` (one MLP per layer) or ``moe`` (routed experts)."""


@dataclass(frozen=True)
class ModelType:
    name: str            # config.json's model_type
    decoder: str         # the language model's family: itself for a text decoder
    vision: bool = False  # a vision-language model (loads with AutoModelForImageTextToText)
    video: bool = False   # its prompts may carry videos
    kind: str = "dense"   # its decoder's kind (DECODER_KINDS): the family's decoder layout must be of it

    def __post_init__(self) -> None:
        if self.kind not in DECODER_KINDS:
            raise ValueError(f"model type {self.name!r}: kind={self.kind!r}; valid: {', '.join(DECODER_KINDS)}")


MODEL_TYPES: dict[str, ModelType] = {t.name: t for t in (
    ModelType("qwen2", "qwen2"),
    ModelType("qwen3", "qwen3"),
    ModelType("llama", "llama"),
    ModelType("mistral", "mistral"),
    ModelType("qwen3_moe", "qwen3_moe", kind="moe"),  # Qwen3-30B-A3B, Qwen3-235B-A22B
    ModelType("qwen2_vl", "qwen2", vision=True, video=True),
    ModelType("qwen2_5_vl", "qwen2", vision=True, video=True),
    ModelType("qwen3_vl", "qwen3", vision=True),  # Qwen3-VL writes video timestamps into the text: not yet
)}

DECODER_TYPES: tuple[str, ...] = tuple(n for n, t in MODEL_TYPES.items() if not t.vision)
"""Text decoders."""
VISION_LANGUAGE_NAMES: tuple[str, ...] = tuple(n for n, t in MODEL_TYPES.items() if t.vision)
"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), in the table's order (for messages)."""
VISION_LANGUAGE_TYPES: frozenset[str] = frozenset(VISION_LANGUAGE_NAMES)
VIDEO_TYPES: frozenset[str] = frozenset(n for n, t in MODEL_TYPES.items() if t.video)
"""Vision-language models whose prompts may carry videos."""


def decoder_family(model_type: str) -> str:
    """The language model's family of ``model_type`` (``qwen2_5_vl`` -> ``qwen2``); unknown: itself."""
    t = MODEL_TYPES.get(model_type)
    return t.decoder if t else model_type
