"""Qwen-VL pixels: images and video frames to the model's inputs exactly as transformers'
``Qwen2VLImageProcessorPil`` / video processor make them, and back (the vLLM engine takes images,
not pixel values). ``spec``: the model's :class:`~fitrl.models.families.qwen_vl.media.VisionSpec`,
read here through :class:`Patching` (what this module asks of it), since media.py imports this one.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from PIL import Image

from fitrl.core.errors import DataError
from fitrl.data.images import smart_resize


class Patching(Protocol):
    """What the pixel code reads of a model's vision spec (fitrl/models/families/qwen_vl/media.py,
    ``VisionSpec``, which is one)."""

    model_type: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    supports_video: bool

    @property
    def factor(self) -> int: ...


@functools.lru_cache(maxsize=8)
def _image_processor(spec: Patching, min_pixels: int, max_pixels: int):
    # The PIL backend: transformers' default one needs torchvision, which this install lacks.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=spec.patch_size,
                                    merge_size=spec.merge_size, temporal_patch_size=spec.temporal_patch_size,
                                    image_mean=list(spec.image_mean), image_std=list(spec.image_std))


def process_images(images: list[Image.Image], spec: Patching, min_pixels: int, max_pixels: int) -> dict:
    """``pixel_values`` (float32, ``(sum of t*h*w patches, C * temporal_patch * patch * patch)``)
    and ``image_grid_thw`` (int64, ``(len(images), 3)``, each ``[1, h'/patch, w'/patch]``) of RGB
    images, as ``Qwen2VLImageProcessorPil`` makes them with these pixel limits."""
    out = _image_processor(spec, min_pixels, max_pixels)(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def images_from_pixels(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, spec: Patching) -> list[Image.Image]:
    """The resized RGB images that :func:`process_images` patchified, recovered exactly: undo the
    patch layout and the normalisation, round to 8 bits (the resized image was 8-bit, so the
    round trip is exact up to float error far below half a level). An engine that takes images
    rather than patches (vLLM) gets the very pixels the trainer sees, at their resized size."""
    # an image's temporal copies are the same picture: its first frame
    return [Image.fromarray(frames[0], "RGB") for frames in _unpatchify(pixel_values, image_grid_thw, spec)]


def frames_from_pixels(pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor, spec: Patching):
    """The frames of each video that :func:`process_videos` patchified, as uint8 arrays
    ``(grid_t * temporal_patch_size, h', w', 3)``: sampled, padded to whole temporal patches and
    resized, exactly as the trainer sees them (see :func:`images_from_pixels`)."""
    return _unpatchify(pixel_values_videos, video_grid_thw, spec)


def _unpatchify(pixel_values: torch.Tensor, grid_thw: torch.Tensor, spec: Patching):
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    mean = torch.tensor(spec.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(spec.image_std, dtype=torch.float64)[:, None, None]
    items, start = [], 0
    for grid_t, gh, gw in grid_thw.tolist():
        n = grid_t * gh * gw
        # rows: (grid_t, gh/m, gw/m, m, m) patches; columns: (C, temporal, p, p)
        x = pixel_values[start:start + n].double().reshape(grid_t, gh // m, gw // m, m, m, -1, t, p, p)
        start += n
        x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(grid_t * t, -1, gh * p, gw * p)  # (frames, C, H, W)
        rgb = ((x * std + mean) * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        items.append(rgb.numpy())
    return items


def sample_frames(n_frames: int, max_frames: int) -> list[int]:
    """Indices of at most ``max_frames`` frames spread evenly over ``n_frames`` (the first is
    always kept): ``floor(i * n_frames / max_frames)``, as transformers' video processors sample.

    >>> sample_frames(10, 4)
    [0, 2, 5, 7]
    """
    if n_frames <= max_frames:
        return list(range(n_frames))
    return [i * n_frames // max_frames for i in range(max_frames)]


def check_video_support(spec: Patching) -> None:
    if not spec.supports_video:
        raise DataError(f"videos are not supported for {spec.model_type} yet; drop the video column "
                        f"(data.video_key) or use a Qwen2-VL / Qwen2.5-VL model")


def process_videos(videos: list[list[Image.Image]], spec: Patching, *, fps: float, max_frames: int,
                   max_pixels: int, min_pixels: int) -> dict:
    """Model inputs of videos given as lists of RGB frames.

    Each video: frames subsampled evenly to ``max_frames`` (:func:`sample_frames`), the count
    padded to a multiple of ``temporal_patch_size`` by repeating the last frame, every frame
    resized to the first frame's :func:`smart_resize` size with the per-frame budget
    ``max_pixels``, rescaled and normalised as images are, and patchified in the layout of
    transformers' ``Qwen2VLVideoProcessor.patchify`` (which needs torchvision, so it is redone
    here in numpy). Returns ``pixel_values_videos`` (float32, ``(sum of t*h*w, C*tp*p*p)``),
    ``video_grid_thw`` (int64, ``(len(videos), 3)``) and, for Qwen2.5-VL (the only model that
    reads it), ``second_per_grid_ts`` (float32, ``(len(videos),)``: ``temporal_patch_size / fps``).
    """
    import numpy as np
    import torch

    check_video_support(spec)
    proc = _image_processor(spec, min_pixels, max_pixels)
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    all_patches, grids = [], []
    for frames in videos:
        if not frames:
            raise ValueError("a video needs at least one frame")
        frames = [frames[i] for i in sample_frames(len(frames), max_frames)]
        frames += [frames[-1]] * (-len(frames) % tp)
        w0, h0 = frames[0].size
        h, w = smart_resize(h0, w0, factor=spec.factor, min_pixels=min_pixels, max_pixels=max_pixels)
        arrays = []
        for f in frames:
            x = np.asarray(f.convert("RGB").resize((w, h), resample=Image.Resampling.BICUBIC)).transpose(2, 0, 1)
            x = proc.normalize(proc.rescale(x, 1 / 255), list(spec.image_mean), list(spec.image_std))
            arrays.append(np.asarray(x, dtype=np.float32))
        video = np.stack(arrays)  # (T, C, H, W)
        t, c = video.shape[:2]
        gt, gh, gw = t // tp, h // p, w // p
        patches = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        # (gt, gh/m, gw/m, mh, mw, C, tp, ph, pw): Qwen2VLVideoProcessor.patchify without the batch axis
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        all_patches.append(patches.reshape(gt * gh * gw, c * tp * p * p))
        grids.append([gt, gh, gw])
    out = {"pixel_values_videos": torch.from_numpy(np.concatenate(all_patches)),
           "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
    if spec.model_type == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.full((len(videos),), tp / fps, dtype=torch.float32)
    return out
