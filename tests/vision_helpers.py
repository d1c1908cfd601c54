"""Shared by the vision data tests: vision specs, a tiny tokenizer with Qwen's vision tokens
(no model directory needed), and pictures built in memory (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from fitrl.models.families.qwen_vl.media import VisionSpec

QWEN25 = VisionSpec("qwen2_5_vl")
QWEN2 = VisionSpec("qwen2_vl")
QWEN3 = VisionSpec("qwen3_vl", patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, supports_video=False)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MARK = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="session")
def tokenizer():
    """A tiny byte-level BPE with ChatML and Qwen's four vision tokens (no model directory needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is in the image? Describe the picture.", "user assistant system"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML, additional_special_tokens=specials[3:])


def rgb(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def encode(img, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header(w, h) -> bytes:
    """A PNG that is only a signature and an IHDR chunk claiming ``w x h``: no pixels at all."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def gif_animated() -> bytes:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
