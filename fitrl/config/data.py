"""The ``data`` section: prompt files and columns, templating, lengths, and the
vision-language data options. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from fitrl.core.errors import ConfigError

@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training prompts: jsonl, json or parquet files, a directory saved by ``datasets.save_to_disk``, or a Hugging Face Hub dataset ``org/name@split`` (``org/name:config@split`` for one of several configs; the split defaults to ``train``) read through ``datasets`` and the Hugging Face cache (docs/hub.md)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompts for validation (same formats); empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (or a list of chat messages)."""
    answer_key: str = "answer"
    """Column holding the reference answer passed to the reward function; empty: the rows have none (what ``fitrl.train`` sets when its reward functions read no answer, as TRL's need none)."""
    source_key: str = "data_source"
    """Column naming the benchmark or source a row comes from (e.g. ``gsm8k``); when validation rows carry it, ``val/*`` metrics are also split by it (``val/by_source/<source>/...``)."""
    prompt_template: Optional[str] = None
    """Optional jinja template rendered with the row's columns to form the user message, e.g. ``'Compute {{ prompt }}'``."""
    system_prompt: Optional[str] = None
    """Optional system message put before the user message."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (with the generation prompt)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped; the count dropped is reported at start-up."""
    rollout_batch_size: int = 8
    """Prompts drawn per RL step."""
    val_batch_size: int = 64
    """Prompts per generation call during validation (memory knob only; all val prompts are used)."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by ``trainer.seed``)."""
    # Vision-language data (read when the policy is a vision-language family; docs/vision.md)
    image_key: str = "images"
    """Column holding a row's images: a path (relative to ``data.image_dir``), raw bytes, a ``datasets`` Image value (``{'bytes', 'path'}``), or a list of them. A row without it (or null, or []) has no image."""
    image_dir: Optional[str] = None
    """Directory that relative image paths are read from (default: the directory of the data file holding the row)."""
    image_placeholder: str = "<image>"
    """Text in the prompt that marks where each image goes (in order); a row with images and no placeholder gets them before its text."""
    min_pixels: int = 3136
    """Images smaller than this many pixels are upscaled (aspect kept) to at least this; with ``max_pixels`` this is the pixel budget the dataset, the processor, the rollout and the plan share."""
    max_pixels: int = 1048576
    """Images larger than this many pixels are downscaled (aspect kept) to at most this before the processor; sets the image tokens per image (about max_pixels / 784 for Qwen2/2.5-VL, / 1024 for Qwen3-VL)."""
    limit_images: int = 4
    """Most images (and videos) one prompt may hold; a row with more is a bad row (``data.on_bad_image``)."""
    on_bad_image: Literal["error", "skip"] = "error"
    """A missing, corrupt, empty or oversized image, or a row with more images than ``limit_images`` or placeholders than images: ``error`` stops at start-up naming the file and row; ``skip`` drops the row and reports how many were dropped and why."""
    max_image_side: int = 16384
    """Images whose width or height (as the file header says) exceed this are refused before decoding (decompression bombs)."""
    video_key: str = "videos"
    """Column holding a row's videos, each a list of frames (any image form above); the prompt marks each with ``data.video_placeholder``."""
    video_placeholder: str = "<video>"
    """Text in the prompt that marks where each video goes."""
    video_fps: float = 2.0
    """Frames per second of the frame lists in ``data.video_key`` (sets the temporal position step of Qwen2.5-VL)."""
    max_frames: int = 16
    """Longer frame lists are subsampled evenly to this many frames."""
    video_max_pixels: int = 65536
    """Per-frame pixel budget of videos (frames are downscaled to at most this many pixels)."""

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "max_image_side", "max_frames", "video_max_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}")
        if self.limit_images < 0:
            raise ConfigError(f"data.limit_images must be >= 0, got {self.limit_images}")
        if not (math.isfinite(self.video_fps) and self.video_fps > 0):
            raise ConfigError(f"data.video_fps must be > 0, got {self.video_fps}")
        if not self.image_placeholder or not self.video_placeholder or self.image_placeholder == self.video_placeholder:
            raise ConfigError("data.image_placeholder and data.video_placeholder must be non-empty and different")
