"""What the prompt data asks of a vision-language model's media handling (:class:`MediaSpec`), and
what it keeps of a row's images and videos (:class:`RowMedia`).

The data layer never knows a model family: a family that takes images implements
:class:`MediaSpec` in its own folder (the Qwen-VL one: fitrl/models/families/qwen_vl/media.py)
and hands it out as ``ModelFamily.media_spec(model_path)``; :class:`fitrl.data.dataset.PromptDataset`
calls it at the four points where a row's media matter (docs/vision.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from PIL import Image

if TYPE_CHECKING:
    from fitrl.config.data import DataConfig


@dataclass
class RowMedia:
    """A row's images and videos as kept for the run: references (resolved path or bytes), never
    pixels, and the size each is resized to."""

    images: list[bytes | str] = field(default_factory=list)
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    """``(h', w')`` per image after resizing to the processor's grid."""
    videos: list[list[bytes | str]] = field(default_factory=list)
    """Per video, its sampled frames (before the temporal padding)."""
    video_sizes: list[tuple[int, int, int]] = field(default_factory=list)
    """``(frames after padding, h', w')`` per video."""
    image_tokens: list[int] = field(default_factory=list)
    video_tokens: list[int] = field(default_factory=list)


def video_pixel_limits(opts: DataConfig) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of one video frame: ``data.video_max_pixels`` caps it, and
    ``data.min_pixels`` floors it unless that is above the cap."""
    return min(opts.min_pixels, opts.video_max_pixels), opts.video_max_pixels


class MediaSpec(Protocol):
    """A vision-language model's media handling, as the prompt data uses it."""

    model_type: str
    supports_video: bool

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse (``ModelDirError``) a tokenizer without the model's media tokens."""

    def read_row_media(self, source: str, row: dict, messages: list[dict], *, opts: DataConfig,
                       base_dir: Optional[str]) -> tuple[list[dict], RowMedia]:
        """The row's messages with its media markers, and its media read and checked at start-up
        (a bad image is ``fitrl.data.images.BadImage``)."""

    def expand_placeholders(self, text: str, image_tokens: list[int], video_tokens: list[int]) -> str:
        """The templated prompt with one media token per image token: the text its ids encode."""

    def model_inputs(self, images: list[Image.Image], videos: list[list[Image.Image]], media: RowMedia,
                     opts: DataConfig, source: str) -> dict:
        """The model's extra inputs of one row's decoded images and videos (``multi_modal_inputs``),
        checked against the sizes read at start-up (``DataError`` when they changed)."""
