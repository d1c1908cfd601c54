"""Reading one image safely, and the Qwen-VL pixel budget (``smart_resize``) that sets its tokens.

Pure PIL and numpy: no torchvision. Every way an image can be unusable is a :class:`BadImage`
with a short ``kind`` (what the start-up summary counts, e.g. ``truncated``) and a ``reason``
(the sentence the user reads). The dataset adds the file, row and image number
(:mod:`fitrl.data.dataset`).

What is refused, and when:

- before decoding, from the header: a missing or empty file, bytes PIL cannot identify, a width
  or height of 0, a side over ``max_side`` (``data.max_image_side``), more pixels than PIL's
  decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``), an animated image (several frames:
  frames belong in the video column);
- while decoding (always in full, with ``ImageFile.LOAD_TRUNCATED_IMAGES`` off, so a cut file
  cannot pass as an image with a grey bottom half): truncated or corrupt data;
- after: an aspect ratio over 200 (:func:`smart_resize`, as Qwen's processor refuses it).

Every mode comes out RGB; transparency (RGBA, LA, P with a transparent colour, PA) is composited
on white, since a transparent pixel stored as black would otherwise turn black.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from typing import Any, Optional

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses anything longer-and-thinner than this


class BadImage(Exception):
    """An image that cannot be used. ``kind``: a short category counted in the start-up summary
    (``missing file``, ``truncated``, ...); ``reason``: the message for the user."""

    def __init__(self, kind: str, reason: Optional[str] = None) -> None:
        self.kind = kind
        self.reason = reason or kind
        super().__init__(self.reason)


# --------------------------------------------------------------------------------------------
# Loading


def resolve_path(path: str, base_dir: Optional[str]) -> str:
    """``path`` as it will be opened: relative paths are under ``base_dir``."""
    path = os.path.expanduser(path)
    if base_dir is not None and not os.path.isabs(path):
        return os.path.join(base_dir, path)
    return path


def image_bytes_or_path(value: Any, *, base_dir: Optional[str] = None) -> bytes | str:
    """The lightweight reference to keep for one image value: its resolved path, or its bytes.

    ``value``: a path, raw bytes, a ``datasets`` Image value ``{"bytes", "path"}`` (its bytes
    win when present) or a PIL image (encoded to PNG bytes: lossless, and the pixels are not
    kept). Anything else is a :class:`BadImage`.
    """
    if isinstance(value, str):
        if not value:
            raise BadImage("not an image", "empty path")
        return resolve_path(value, base_dir)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return image_bytes_or_path(value["bytes"], base_dir=base_dir)
        if value.get("path"):
            return image_bytes_or_path(value["path"], base_dir=base_dir)
        raise BadImage("not an image", "image value has neither bytes nor path")
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise BadImage("not an image", f"expected a path, bytes or {{'bytes', 'path'}}, got {type(value).__name__}")


def load_image(value: Any, *, base_dir: Optional[str] = None, max_side: int = 16384) -> Image.Image:
    """Open, check and fully decode one image; return it as an RGB ``PIL.Image``.

    ``value``: a path (relative to ``base_dir``), raw bytes, a ``datasets`` Image value
    ``{"bytes", "path"}``, or a PIL image. Raises :class:`BadImage` (see the module docstring).
    """
    if isinstance(value, Image.Image):
        return _checked_rgb(value, max_side)
    ref = image_bytes_or_path(value, base_dir=base_dir)
    if isinstance(ref, str):
        if not os.path.exists(ref):
            raise BadImage("missing file", "file not found")
        if not os.path.isfile(ref):
            raise BadImage("missing file", "not a file")
        if os.path.getsize(ref) == 0:
            raise BadImage("empty file", "empty file (0 bytes)")
        source: Any = ref
    else:
        if not ref:
            raise BadImage("empty file", "empty image bytes (0 bytes)")
        source = io.BytesIO(ref)
    try:
        with warnings.catch_warnings():
            # PIL warns between MAX_IMAGE_PIXELS and twice that, and raises above: refuse both.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(source)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadImage("too large", f"too many pixels to decode safely ({_short(e)})") from None
    except UnidentifiedImageError:
        if (size := _png_header_size(source)) is not None and 0 in size:  # PIL refuses these unnamed
            raise BadImage("zero size", f"zero-size image ({size[0]}x{size[1]})") from None
        raise BadImage("not an image", "not an image or corrupt (PIL cannot identify it)") from None
    except OSError as e:  # a header cut short reads as a truncated file, anything else as corrupt
        raise BadImage(*_decode_error(e)) from None
    try:
        return _checked_rgb(img, max_side)
    finally:
        img.close()


def _checked_rgb(img: Image.Image, max_side: int) -> Image.Image:
    w, h = img.size
    if w == 0 or h == 0:
        raise BadImage("zero size", f"zero-size image ({w}x{h})")
    if w > max_side or h > max_side:
        raise BadImage("too large", f"image is {w}x{h}, a side over data.max_image_side={max_side}; "
                                    f"refused before decoding")
    frames = getattr(img, "n_frames", 1)
    if frames > 1 and img.format != "MPO":  # MPO: a camera JPEG with extra views; the first is the photo
        raise BadImage("animated", f"animated image ({frames} frames); use a video column for frames")
    # A library that set LOAD_TRUNCATED_IMAGES would let a cut file decode with its missing rows
    # filled in; this check must see the truncation.
    was = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        img.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise BadImage(*_decode_error(e)) from None
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = was
    return to_rgb(img)


def _png_header_size(source: Any) -> Optional[tuple[int, int]]:
    """Width and height from a PNG's IHDR (bytes 16-24), or None for anything else."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            head = f.read(24)
    else:
        head = source.getvalue()[:24]
    if len(head) < 24 or not head.startswith(b"\x89PNG\r\n\x1a\n") or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _decode_error(e: Exception) -> tuple[str, str]:
    msg = _short(e)
    if "truncated" in msg.lower():
        return "truncated", "truncated file"
    return "corrupt", f"corrupt image data ({msg})"


def _short(e: Exception) -> str:
    return str(e).split(", could be")[0].strip() or type(e).__name__


def to_rgb(img: Image.Image) -> Image.Image:
    """A new RGB image: alpha composited on white; 16/32-bit grey scaled to 8 bits, not clipped."""
    mode = img.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode.startswith("I;16") or mode == "I":
        # PIL's own I;16 -> L clips at 255, so every value above 255 of a 16-bit scan turns white.
        arr = np.asarray(img).astype(np.int64)
        grey = (np.clip(arr, 0, 65535) >> 8).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    try:
        return img.convert("RGB")  # RGB (a copy), L, 1, P, CMYK, YCbCr, F
    except ValueError as e:
        raise BadImage("unsupported mode", f"image mode {mode} cannot be converted to RGB ({e})") from None


# --------------------------------------------------------------------------------------------
# The pixel budget


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size Qwen2/2.5/3-VL resize an image to: both sides multiples of ``factor``
    (``patch_size * merge_size``), about ``min_pixels``..``max_pixels`` pixels, aspect kept.

    Sides are rounded to the nearest multiple; if that is over ``max_pixels`` both are scaled by
    ``sqrt(h*w / max_pixels)`` and floored, if under ``min_pixels`` scaled up and ceiled. The same
    arithmetic as transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize``.

    >>> smart_resize(100, 200, factor=28, min_pixels=3136, max_pixels=28 * 28 * 16)
    (56, 140)
    """
    if height < 1 or width < 1:
        raise BadImage("zero size", f"zero-size image ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadImage("aspect ratio", f"image is {width}x{height}: aspect ratio over {MAX_ASPECT_RATIO}, "
                                       f"which Qwen-VL processors refuse")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(height: int, width: int, spec: Any, min_pixels: int, max_pixels: int) -> int:
    """Language-model tokens of one image of ``height x width`` pixels (before resizing):
    ``(h'/patch) * (w'/patch) / merge**2`` with ``(h', w')`` from :func:`smart_resize`.
    ``spec``: anything with ``patch_size`` and ``merge_size`` (a Qwen-VL ``VisionSpec``).

    >>> from types import SimpleNamespace
    >>> image_tokens(100, 200, SimpleNamespace(patch_size=14, merge_size=2), 3136, 28 * 28 * 16)
    10
    """
    factor = spec.patch_size * spec.merge_size
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size ** 2
