"""What the memory plan and the FLOP counter ask of a vision-language model's tower
(:class:`VisionTower`, a family's description of its ``vision_config``) and one image as the
processor hands it to the model (:class:`VisualInput`).

Apart from fitrl/models/shape.py, which asks the families for their towers, so that the families
(fitrl/models/families/base.py, qwen_vl/tower.py) import these types without importing the
shape, as they import fitrl/models/decoder.py for their decoders. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class VisionTower(Protocol):
    """What the memory plan and the FLOP counter ask of a vision tower (a family's description of
    its ``vision_config``): its patch geometry, its parameter tensors and its forward FLOPs."""

    kind: str             # the model type it belongs to
    depth: int
    hidden: int
    patch: int
    temporal_patch: int
    merge: int
    in_chans: int

    @property
    def factor(self) -> int:
        """Pixels per side of one language-model token (``patch * merge``)."""

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter of the tower (and its mergers), named as the model names them."""

    def forward_flops(self, patches: int) -> int:
        """Forward FLOPs over one image (or video) of ``patches`` patches."""

    def activation_widths(self, grad: bool, checkpointing: bool) -> tuple[tuple[int, int], ...]:
        """``(count, width)`` of the activations one pass holds at its peak, each ``patches x width``."""

    def largest_image(self, max_pixels: int, min_pixels: int = 0) -> "VisualInput":
        """The largest image the processor can emit within the pixel budget."""


@dataclass(frozen=True)
class VisualInput:
    """One image (``frames=1``; a video has more) as the processor hands it to the model: frames of
    ``height x width`` pixels (multiples of ``patch * merge``) cut into patches of
    ``temporal_patch x patch x patch`` pixels. A still image is one frame repeated over the temporal
    patch, so its ``pixel_values`` hold every pixel twice (Qwen2-VL's processor, ``patchify``)."""
    vision: VisionTower
    frames: int
    height: int
    width: int

    @property
    def grid(self) -> tuple[int, int, int]:
        """``image_grid_thw``: (frames / temporal patch, rounded up; rows; columns) of patches."""
        v = self.vision
        return -(-self.frames // v.temporal_patch), self.height // v.patch, self.width // v.patch

    @property
    def patches(self) -> int:
        """Vision-tower tokens: the rows of ``pixel_values``."""
        t, h, w = self.grid
        return t * h * w

    @property
    def llm_tokens(self) -> int:
        """Language-model tokens (image pad tokens in the prompt): patches merged ``merge x merge``."""
        return self.patches // self.vision.merge**2

    @property
    def pixel_values_bytes(self) -> int:
        """The processor's fp32 ``pixel_values``, (patches, C * t * p * p): for a still image
        ``patches * 3 * 2 * 14 * 14 * 4`` bytes = 24 bytes per resized pixel (Qwen2/2.5-VL; the
        same per pixel for Qwen3-VL's 16 x 16 patches)."""
        v = self.vision
        return self.patches * v.in_chans * v.temporal_patch * v.patch * v.patch * 4
