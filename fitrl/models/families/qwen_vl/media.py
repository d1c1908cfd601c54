"""What a Qwen2-VL / Qwen2.5-VL / Qwen3-VL policy needs from the data: the vision spec of a
model directory, pixels turned into model inputs, and image tokens in the prompt.

Three steps take a row from text with ``<image>`` to the model's inputs (docs/vision.md):

1. :func:`insert_vision_markers`: each ``data.image_placeholder`` in the user text becomes
   ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per image; likewise videos), or, when
   the text has none, the images go before the text of the first user message;
2. the chat template, then :func:`expand_placeholders`: the k-th ``<|image_pad|>`` becomes as
   many pads as image k has tokens, so the prompt ids hold the image tokens and
   ``data.max_prompt_length`` counts them;
3. :func:`process_images` / :func:`process_videos` (per batch, in
   :meth:`fitrl.data.dataset.PromptDataset.multi_modal_inputs`, through
   :meth:`VisionSpec.model_inputs`): ``pixel_values`` and ``image_grid_thw`` exactly as
   transformers' ``Qwen2VLImageProcessorPil`` makes them (:mod:`.pixels`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from PIL import Image

from fitrl.core.errors import DataError, ModelDirError
from fitrl.core.model_types import VIDEO_TYPES, VISION_LANGUAGE_NAMES
from fitrl.data.images import BadImage, image_bytes_or_path, load_image, smart_resize
from fitrl.data.media import RowMedia, video_pixel_limits
from fitrl.models.config_json import read_config_json
from fitrl.models.families.qwen_vl.pixels import (check_video_support, frames_from_pixels, images_from_pixels,
                                                  process_images, process_videos, sample_frames)

if TYPE_CHECKING:
    from fitrl.config.data import DataConfig

VL_MODEL_TYPES = VISION_LANGUAGE_NAMES

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2-VL's processor defaults
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Token ids transformers' Qwen-VL configs default to when config.json leaves them out.
_DEFAULT_IDS = {"image_token_id": 151655, "video_token_id": 151656,
                "vision_start_token_id": 151652, "vision_end_token_id": 151653}


@dataclass(frozen=True)
class VisionSpec:
    """The vision side of a Qwen-VL model directory: patching, normalisation, special tokens."""

    model_type: str
    """``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``."""
    patch_size: int = 14
    """Side of a vision patch in pixels (14 for Qwen2/2.5-VL, 16 for Qwen3-VL)."""
    merge_size: int = 2
    """Patches merged per side into one language-model token (2: 4 patches per token)."""
    temporal_patch_size: int = 2
    """Frames per temporal patch (an image is repeated to fill it)."""
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    image_token: str = "<|image_pad|>"
    video_token: str = "<|video_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    supports_video: bool = True
    token_ids: Optional[tuple[tuple[str, int], ...]] = None
    """``(token, id)`` pairs from config.json that the tokenizer must agree with (None: not checked)."""

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Optional[VisionSpec]:
        """The spec of the model in ``path``; ``None`` for a model that is not a Qwen-VL.

        Reads ``config.json`` (model type, token ids, the vision tower's patching) and
        ``preprocessor_config.json`` (patching, mean and std); a missing or unreadable file, or
        the two disagreeing on the patching, is a :class:`ModelDirError` naming the file.
        """
        path = Path(path)
        config = read_config_json(path, what="model directory")
        model_type = config.get("model_type")
        if model_type not in VL_MODEL_TYPES:
            return None
        pre_file = path / "preprocessor_config.json"
        if not pre_file.is_file():
            raise ModelDirError(f"{pre_file}: not found; a {model_type} model directory needs it "
                                f"(copy it from the original checkpoint)")
        pre = _read_json(pre_file)
        vc = config.get("vision_config") or {}
        values: dict[str, Any] = {}
        for key, tower_key in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                               ("temporal_patch_size", "temporal_patch_size")):
            value = pre.get(key, vc.get(tower_key, getattr(cls, key)))
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ModelDirError(f"{pre_file}: {key} must be a positive integer, got {value!r}")
            if tower_key in vc and vc[tower_key] != value:
                raise ModelDirError(f"{pre_file}: {key}={value} but {path / 'config.json'} has "
                                    f"vision_config.{tower_key}={vc[tower_key]}; the processor must patch "
                                    f"images as the vision tower expects")
            values[key] = value
        for key, default in (("image_mean", OPENAI_CLIP_MEAN), ("image_std", OPENAI_CLIP_STD)):
            value = pre.get(key, default)
            if isinstance(value, (int, float)):
                value = [value] * 3
            if not (isinstance(value, (list, tuple)) and len(value) == 3
                    and all(isinstance(v, (int, float)) for v in value)):
                raise ModelDirError(f"{pre_file}: {key} must be a list of 3 numbers, got {value!r}")
            if key == "image_std" and not all(v > 0 for v in value):
                raise ModelDirError(f"{pre_file}: image_std must be > 0, got {value!r}")
            values[key] = tuple(float(v) for v in value)
        ids = []
        for token, key in (("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id"),
                           ("<|vision_start|>", "vision_start_token_id"), ("<|vision_end|>", "vision_end_token_id")):
            value = config.get(key, (config.get("text_config") or {}).get(key, _DEFAULT_IDS[key]))
            if isinstance(value, int):
                ids.append((token, value))
        return cls(model_type=model_type, supports_video=model_type in VIDEO_TYPES,
                   token_ids=tuple(ids), **values)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer must hold each vision token as one token, with the id config.json gives."""
        expected = dict(self.token_ids or ())
        for token in (self.image_token, self.video_token, self.vision_start, self.vision_end):
            tid = tokenizer.convert_tokens_to_ids(token)
            unk = getattr(tokenizer, "unk_token_id", None)
            if tid is None or (unk is not None and tid == unk):
                raise ModelDirError(f"the tokenizer has no {token} token, which {self.model_type} prompts need; "
                                    f"use the tokenizer of the vision-language checkpoint")
            if token in expected and tid != expected[token]:
                raise ModelDirError(f"the tokenizer maps {token} to id {tid} but config.json says {expected[token]}; "
                                    f"the tokenizer does not belong to this model")
            if tokenizer.encode(token, add_special_tokens=False) != [tid]:
                raise ModelDirError(f"the tokenizer splits {token} into several tokens; it must be a special "
                                    f"(added) token of the tokenizer")

    # -------------------------------------------------------------- the data's questions (fitrl.data.media.MediaSpec)
    def read_row_media(self, source: str, row: dict, messages: list[dict], *, opts: DataConfig,
                       base_dir: Optional[str]) -> tuple[list[dict], RowMedia]:
        return read_row_media(source, row, messages, spec=self, opts=opts, base_dir=base_dir)

    def expand_placeholders(self, text: str, image_tokens: Sequence[int], video_tokens: Sequence[int]) -> str:
        return expand_placeholders(text, image_tokens, video_tokens, self)

    def model_inputs(self, images: list[Image.Image], videos: list[list[Image.Image]], media: RowMedia,
                     opts: DataConfig, source: str) -> dict:
        """``pixel_values`` / ``image_grid_thw`` (and the video counterparts) of one row, whose
        grids must be the ones its prompt's pad tokens were counted from at start-up."""
        out: dict = {}
        if images:
            out.update(process_images(images, self, opts.min_pixels, opts.max_pixels))
            expected = [[1, h // self.patch_size, w // self.patch_size] for h, w in media.image_sizes]
            if out["image_grid_thw"].tolist() != expected:
                raise DataError(f"{source}: an image of this row changed size since start-up; its image "
                                f"tokens no longer match the prompt")
        if videos:
            vmin, vmax = video_pixel_limits(opts)
            out.update(process_videos(videos, self, fps=opts.video_fps, max_frames=opts.max_frames,
                                      max_pixels=vmax, min_pixels=vmin))
            expected = [[t // self.temporal_patch_size, h // self.patch_size, w // self.patch_size]
                        for t, h, w in media.video_sizes]
            if out["video_grid_thw"].tolist() != expected:
                raise DataError(f"{source}: a video frame of this row changed size since start-up; its "
                                f"tokens no longer match the prompt")
        return out

    # -------------------------------------------------------------- the vLLM engine's (it takes images, not pixels)
    def images_from_pixels(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[Image.Image]:
        return images_from_pixels(pixel_values, image_grid_thw, self)

    def frames_from_pixels(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor):
        return frames_from_pixels(pixel_values_videos, video_grid_thw, self)


def _read_json(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"{file}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{file}: cannot be read as JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ModelDirError(f"{file}: expected a JSON object")
    return doc


# --------------------------------------------------------------------------------------------
# Prompt text


def vision_marker(spec: VisionSpec, video: bool = False) -> str:
    """What one placeholder becomes before the chat template: start, one pad, end."""
    return f"{spec.vision_start}{spec.video_token if video else spec.image_token}{spec.vision_end}"


def insert_vision_markers(messages: list[dict], n_images: int, n_videos: int, *, spec: VisionSpec,
                          image_placeholder: str, video_placeholder: str) -> list[dict]:
    """Replace each placeholder in the messages with its vision marker (one pad token each).

    A row with images (or videos) and no placeholder for them gets their markers before the text
    of its first user message, in order (EasyR1's convention); a row whose placeholders do not
    match its images is a :class:`BadImage` (``placeholder mismatch``).
    """
    out = [dict(m) for m in messages]
    for n, placeholder, video, noun in ((n_images, image_placeholder, False, "image"),
                                        (n_videos, video_placeholder, True, "video")):
        found = sum(m["content"].count(placeholder) for m in out)
        marker = vision_marker(spec, video)
        if found == 0 and n > 0:
            user = next((m for m in out if m["role"] == "user"), None)
            if user is None:
                raise BadImage("placeholder mismatch", f"row has {_n(n, noun)} but no user message to put them in")
            user["content"] = marker * n + user["content"]
        elif found != n:
            raise BadImage("placeholder mismatch", f"{_n(found, placeholder + ' placeholder')} but {_n(n, noun)}")
        else:
            for m in out:
                m["content"] = m["content"].replace(placeholder, marker)
    return out


def expand_placeholders(text: str, image_tokens: Sequence[int], video_tokens: Sequence[int],
                        spec: VisionSpec) -> str:
    """Expand the k-th ``<|image_pad|>`` of ``text`` into ``image_tokens[k]`` copies (and the
    k-th ``<|video_pad|>`` into ``video_tokens[k]``). ``text`` must hold exactly one pad per
    image and video (a prompt that already held the token text is a :class:`BadImage`).

    >>> spec = VisionSpec("qwen2_vl")
    >>> expand_placeholders("a<|image_pad|>b<|image_pad|>", [2, 1], [], spec)
    'a<|image_pad|><|image_pad|>b<|image_pad|>'
    """
    for token, counts, noun in ((spec.image_token, image_tokens, "image"), (spec.video_token, video_tokens, "video")):
        parts = text.split(token)
        if len(parts) - 1 != len(counts):
            raise BadImage("placeholder mismatch", f"the prompt holds {len(parts) - 1} {token} tokens for "
                                                   f"{_n(len(counts), noun)}; remove {token} from the text")
        pieces = [parts[0]]
        for n, part in zip(counts, parts[1:]):
            pieces += [token * n, part]
        text = "".join(pieces)
    return text


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------------------------
# One row's images and videos, checked at start-up


def read_row_media(source: str, row: dict, messages: list[dict], *, spec: VisionSpec, opts: DataConfig,
                   base_dir: Optional[str]) -> tuple[list[dict], RowMedia]:
    """The row's messages with vision markers (:func:`insert_vision_markers`) and its media,
    every image and sampled frame decoded in full once and dropped.

    ``opts``: the ``data.*`` image and video keys. A bad image, too many images, placeholders
    that do not match or a malformed column is a :class:`BadImage` whose reason names the image
    (``image 2 of 3 (x.png): truncated file``); the caller applies ``data.on_bad_image``.
    Videos for a model without video support are a :class:`DataError` (no option skips them).
    """
    images = _as_list(row.get(opts.image_key))
    videos = _as_list(row.get(opts.video_key))
    if any(not isinstance(v, (list, tuple)) for v in videos):
        raise BadImage("not a video", f"column {opts.video_key!r} must be a list of videos, each a list of "
                                      f"frames (images); decode video files to frames first")
    n = len(images) + len(videos)
    if n > opts.limit_images:
        held = _n(len(images), "image") + (f" and {_n(len(videos), 'video')}" if videos else "")
        raise BadImage("too many images", f"row has {held}, more than data.limit_images={opts.limit_images}")
    if videos and not spec.supports_video:
        try:
            check_video_support(spec)
        except DataError as e:
            raise DataError(f"{source}: {e}") from None
    messages = insert_vision_markers(messages, len(images), len(videos), spec=spec,
                                     image_placeholder=opts.image_placeholder,
                                     video_placeholder=opts.video_placeholder)
    media = RowMedia()
    for k, value in enumerate(images):
        where = f"image {k + 1} of {len(images)} ({_describe(value)})"
        ref, (h, w) = _checked(value, where, base_dir, opts.max_image_side, spec, opts.min_pixels, opts.max_pixels)
        media.images.append(ref)
        media.image_sizes.append((h, w))
        media.image_tokens.append((h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size ** 2)
    vmin, vmax = video_pixel_limits(opts)
    for k, frames in enumerate(videos):
        if not frames:
            raise BadImage("empty video", f"video {k + 1} of {len(videos)} has no frames")
        kept = sample_frames(len(frames), opts.max_frames)
        refs, size = [], None
        for j in kept:
            where = f"video {k + 1} of {len(videos)}, frame {j + 1} of {len(frames)} ({_describe(frames[j])})"
            ref, hw = _checked(frames[j], where, base_dir, opts.max_image_side, spec, vmin, vmax)
            refs.append(ref)
            size = size or hw  # every frame is resized to the first frame's size
        t = len(refs) + (-len(refs) % spec.temporal_patch_size)
        media.videos.append(refs)
        media.video_sizes.append((t, *size))
        media.video_tokens.append(t // spec.temporal_patch_size * (size[0] // spec.patch_size)
                                  * (size[1] // spec.patch_size) // spec.merge_size ** 2)
    return messages, media


def _checked(value: Any, where: str, base_dir: Optional[str], max_side: int, spec: VisionSpec,
             min_pixels: int, max_pixels: int) -> tuple[bytes | str, tuple[int, int]]:
    try:
        ref = image_bytes_or_path(value, base_dir=base_dir)
        img = load_image(ref, max_side=max_side)
        size = smart_resize(img.height, img.width, factor=spec.factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except BadImage as e:
        raise BadImage(e.kind, f"{where}: {e.reason}") from None
    return ref, size


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("path"):
        return str(value["path"])
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):
        return f"{len(value['bytes'])} bytes"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return type(value).__name__
