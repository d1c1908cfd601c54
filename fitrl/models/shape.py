"""Model shapes from a Hugging Face ``config.json``: every parameter tensor in closed form.

The planner never loads weights: a bare ``config.json`` is enough. ``ModelShape.tensors()``
lists each parameter's name and shape as the transformers modules create them (decoder:
``qwen2``, ``qwen3``, ``llama``, ``mistral``; vision towers of ``qwen2_vl``, ``qwen2_5_vl`` and
``qwen3_vl``), so per-rank shard sizes (FSDP2 pads dim 0 to a multiple of the world size) and
pinned-memory rounding can be computed tensor by tensor. ``tests/test_plan_states.py`` checks
the totals against real models, tensor for tensor.

Images go through the processor's geometry (:meth:`VisionShape.largest_image`): each side resized
to a multiple of ``patch * merge`` pixels within the pixel budget, cut into patches of
``temporal_patch x patch x patch`` pixels, ``merge x merge`` patches per language-model token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fitrl.core.model_types import DECODER_TYPES as DECODERS, VISION_LANGUAGE_NAMES as VISION, decoder_family
MAX_ASPECT_RATIO = 200
"""The Qwen-VL processors refuse an image whose long side is more than 200 times its short side."""


@dataclass(frozen=True)
class VisionShape:
    kind: str             # qwen2_vl | qwen2_5_vl | qwen3_vl
    depth: int
    hidden: int           # embed_dim
    intermediate: int     # MLP width
    out_hidden: int       # the language model's hidden size (merger output)
    patch: int = 14       # 16 for Qwen3-VL
    temporal_patch: int = 2
    merge: int = 2        # spatial_merge_size: merge x merge patches become one LM token
    in_chans: int = 3
    positions: int = 0    # qwen3_vl: learned position embeddings (num_position_embeddings)
    deepstack: int = 0    # qwen3_vl: deepstack mergers (len(deepstack_visual_indexes))
    window_patches: Optional[int] = None  # qwen2_5_vl: patches per attention window ((window_size / patch)^2)
    full_attention_blocks: int = 0        # qwen2_5_vl: blocks attending over the whole image (fullatt_block_indexes)

    @property
    def gated_mlp(self) -> bool:
        return self.kind == "qwen2_5_vl"

    def forward_flops(self, patches: int) -> int:
        """Forward FLOPs (fitrl/models/flops.py, the formula) of the tower over one image (or video)
        of ``patches`` patches, merger included. Attention is non-causal within an image: each
        patch attends all of them (or its window's)."""
        e, i, m2 = self.hidden, self.intermediate, self.merge ** 2
        embed = self.in_chans * self.temporal_patch * self.patch * self.patch * e  # Conv3d = a linear per patch
        block_linear = 3 * e * e + e * e + (3 if self.gated_mlp else 2) * e * i  # qkv, proj, MLP
        if self.window_patches is None:
            attended = [patches] * self.depth
        else:
            window = min(patches, self.window_patches)
            full = min(self.full_attention_blocks, self.depth)
            attended = [patches] * full + [window] * (self.depth - full)
        attention = sum(2 * a * e for a in attended)  # Q.K^T and A.V: a keys x e per patch
        merged = patches // m2
        merger = (e * m2) * (e * m2) + (e * m2) * self.out_hidden
        mergers = 1 + self.deepstack  # Qwen3-VL: one more merger per deepstack layer
        macs = patches * (embed + self.depth * block_linear) + patches * attention + mergers * merged * merger
        return 2 * macs

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        e, i, m2 = self.hidden, self.intermediate, self.hidden * self.merge**2
        if self.kind == "qwen3_vl":
            return self._qwen3_tensors()
        out = [("visual.patch_embed.proj.weight", (e, self.in_chans, self.temporal_patch, self.patch, self.patch))]
        ln = [(e,), (e,)] if self.kind == "qwen2_vl" else [(e,)]  # LayerNorm (weight, bias) vs RMSNorm
        for b in range(self.depth):
            p = f"visual.blocks.{b}."
            out += [(p + f"norm1.{k}", s) for k, s in zip(("weight", "bias"), ln)]
            out += [(p + f"norm2.{k}", s) for k, s in zip(("weight", "bias"), ln)]
            out += [(p + "attn.qkv.weight", (3 * e, e)), (p + "attn.qkv.bias", (3 * e,)),
                    (p + "attn.proj.weight", (e, e)), (p + "attn.proj.bias", (e,))]
            if self.kind == "qwen2_vl":
                out += [(p + "mlp.fc1.weight", (i, e)), (p + "mlp.fc1.bias", (i,)),
                        (p + "mlp.fc2.weight", (e, i)), (p + "mlp.fc2.bias", (e,))]
            else:
                for name in ("gate_proj", "up_proj"):
                    out += [(p + f"mlp.{name}.weight", (i, e)), (p + f"mlp.{name}.bias", (i,))]
                out += [(p + "mlp.down_proj.weight", (e, i)), (p + "mlp.down_proj.bias", (e,))]
        out += [(f"visual.merger.ln_q.{k}", s) for k, s in zip(("weight", "bias"), ln)]
        out += [("visual.merger.mlp.0.weight", (m2, m2)), ("visual.merger.mlp.0.bias", (m2,)),
                ("visual.merger.mlp.2.weight", (self.out_hidden, m2)), ("visual.merger.mlp.2.bias", (self.out_hidden,))]
        return out

    def _qwen3_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Qwen3-VL: a biased patch embedding, learned position embeddings, LayerNorm blocks with a
        plain (fc1, fc2) MLP, the merger, and one more merger per deepstack layer (its LayerNorm
        over the merged width)."""
        e, i, m2 = self.hidden, self.intermediate, self.hidden * self.merge**2
        out = [("visual.patch_embed.proj.weight", (e, self.in_chans, self.temporal_patch, self.patch, self.patch)),
               ("visual.patch_embed.proj.bias", (e,)), ("visual.pos_embed.weight", (self.positions, e))]
        for b in range(self.depth):
            p = f"visual.blocks.{b}."
            out += [(p + f"{norm}.{k}", (e,)) for norm in ("norm1", "norm2") for k in ("weight", "bias")]
            out += [(p + "attn.qkv.weight", (3 * e, e)), (p + "attn.qkv.bias", (3 * e,)),
                    (p + "attn.proj.weight", (e, e)), (p + "attn.proj.bias", (e,)),
                    (p + "mlp.linear_fc1.weight", (i, e)), (p + "mlp.linear_fc1.bias", (i,)),
                    (p + "mlp.linear_fc2.weight", (e, i)), (p + "mlp.linear_fc2.bias", (e,))]
        for prefix, norm in [("visual.merger.", e)] + [(f"visual.deepstack_merger_list.{k}.", m2)
                                                       for k in range(self.deepstack)]:
            out += [(prefix + "norm.weight", (norm,)), (prefix + "norm.bias", (norm,)),
                    (prefix + "linear_fc1.weight", (m2, m2)), (prefix + "linear_fc1.bias", (m2,)),
                    (prefix + "linear_fc2.weight", (self.out_hidden, m2)),
                    (prefix + "linear_fc2.bias", (self.out_hidden,))]
        return out

    @property
    def factor(self) -> int:
        """Pixels per side of one language-model token: the processor resizes each side to a multiple
        of it (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        return self.patch * self.merge

    def largest_image(self, max_pixels: int, min_pixels: int = 0) -> "VisualInput":
        """The largest image the processor can emit within ``max_pixels``. transformers'
        ``smart_resize`` makes each side a multiple of ``f = patch * merge`` with at most
        ``max_pixels`` (and at least ``min_pixels``) pixels; an image already ``a*f x b*f`` with
        ``a*b*f*f <= max_pixels`` passes unchanged and no other comes out larger, so the worst case
        is the largest ``a*b <= max_pixels // f**2`` whose aspect ratio the processor accepts (the
        most square such pair). 4 MP at f=28: 28 x 191 tokens (5,348 of them; a square 2048 x 2048
        image becomes 73 x 73 = 5,329)."""
        f = self.factor
        n = max(1, max_pixels // (f * f), -(-min_pixels // (f * f)))
        for cells in range(n, 0, -1):
            a = next((a for a in range(math.isqrt(cells), 0, -1)
                      if cells % a == 0 and cells // a <= MAX_ASPECT_RATIO * a), None)
            if a is not None:
                return VisualInput(self, 1, a * f, cells // a * f)
        raise AssertionError("unreachable: a 1 x 1 grid is always accepted")


@dataclass(frozen=True)
class VisualInput:
    """One image (``frames=1``; a video has more) as the processor hands it to the model: frames of
    ``height x width`` pixels (multiples of ``patch * merge``) cut into patches of
    ``temporal_patch x patch x patch`` pixels. A still image is one frame repeated over the temporal
    patch, so its ``pixel_values`` hold every pixel twice (Qwen2-VL's processor, ``patchify``)."""
    vision: VisionShape
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


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    vision: Optional[VisionShape] = None
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str | Path, strict: bool = True) -> "ModelShape":
        """From a model directory (only its ``config.json`` is read) or a ``config.json`` file."""
        return cls.from_dict(cls.read_config(path), strict=strict)

    @staticmethod
    def read_config(path: str | Path) -> dict[str, Any]:
        """The ``config.json`` of a model directory (or that file itself), as a dict."""
        p = Path(path)
        return json.loads((p / "config.json" if p.is_dir() else p).read_text())

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], strict: bool = True) -> "ModelShape":
        """``strict``: a model type outside fitrl/core/model_types.py is a ValueError (the memory
        plan lists each tensor: it must know the family); otherwise it is read as a plain dense
        decoder (its text config's dimensions, no vision tower), as far as the FLOPs need."""
        mt = cfg.get("model_type", "")
        known = mt in DECODERS + VISION
        if not known and strict:
            raise ValueError(f"model_type {mt!r} is not modelled by the planner; known: {', '.join(DECODERS + VISION)}")
        text = cfg.get("text_config") or cfg if mt in VISION or not known else cfg
        h, heads = text["hidden_size"], text["num_attention_heads"]
        vision = None
        if mt in VISION:
            v = cfg["vision_config"]
            if mt == "qwen2_vl":
                e = v.get("embed_dim", 1280)
                vision = VisionShape(mt, v["depth"], e, int(e * v.get("mlp_ratio", 4)), v.get("hidden_size", h),
                                     v.get("patch_size", 14), v.get("temporal_patch_size", 2),
                                     v.get("spatial_merge_size", 2), v.get("in_chans", v.get("in_channels", 3)))
            elif mt == "qwen3_vl":  # transformers' Qwen3VLVisionConfig defaults
                vision = VisionShape(mt, v.get("depth", 27), v.get("hidden_size", 1152),
                                     v.get("intermediate_size", 4304), v.get("out_hidden_size", h),
                                     v.get("patch_size", 16), v.get("temporal_patch_size", 2),
                                     v.get("spatial_merge_size", 2),
                                     v.get("in_channels", 3), v.get("num_position_embeddings", 2304),
                                     len(v.get("deepstack_visual_indexes", (8, 16, 24))))
            else:
                window, patch = v.get("window_size"), v.get("patch_size", 14)
                vision = VisionShape(mt, v["depth"], v["hidden_size"], v["intermediate_size"],
                                     v.get("out_hidden_size", h), patch,
                                     v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2),
                                     v.get("in_chans", v.get("in_channels", 3)),
                                     window_patches=(window // patch) ** 2 if window else None,
                                     full_attention_blocks=len(v.get("fullatt_block_indexes", [])))
        family = decoder_family(mt)
        return cls(
            model_type=mt, hidden=h, layers=text["num_hidden_layers"], heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or h // heads, intermediate=text["intermediate_size"],
            vocab=text.get("vocab_size", cfg.get("vocab_size")),
            tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=family == "qwen2" or bool(text.get("attention_bias", False)),
            o_bias=family in ("llama", "mistral") and bool(text.get("attention_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)), qk_norm=family == "qwen3",
            vision=vision, raw=cfg,
        )

    # ------------------------------------------------------------------ tensors
    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        h, d, q, kv, inter = self.hidden, self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim, \
            self.intermediate
        p = f"model.layers.{i}."
        out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{name}.weight", (rows, h)))
            if self.qkv_bias:
                out.append((p + f"self_attn.{name}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, q)))
        if self.o_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        if self.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out.append((p + f"mlp.{name}.weight", shape))
            if self.mlp_bias:
                out.append((p + f"mlp.{name}.bias", (shape[0],)))
        return out

    def tensors(self, with_vision: bool = True) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter (tied embeddings counted once, as ``model.parameters()`` does)."""
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            out += self.layer_tensors(i)
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        if with_vision and self.vision is not None:
            out += self.vision.tensors()
        return out

    def linear_layers(self, with_vision: bool = True) -> list[tuple[str, int, int]]:
        """Every ``nn.Linear`` but the output head: (module name, in_features, out_features). The
        2-D weights of :meth:`tensors` are exactly these, plus the embedding and ``lm_head``."""
        skip = ("model.embed_tokens.weight", "lm_head.weight")
        return [(n[:-len(".weight")], s[1], s[0]) for n, s in self.tensors(with_vision)
                if len(s) == 2 and n.endswith(".weight") and n not in skip]

    def lora_tensors(self, rank: int, targets: tuple[str, ...] | list[str]) -> list[tuple[str, tuple[int, int]]]:
        """LoRA adapters as PEFT's ``inject_adapter_in_model`` adds them (fitrl/models/params.py):
        ``lora_A`` (r, in) and ``lora_B`` (out, r) on every targeted linear layer, r*(in + out)
        parameters each. ``targets``: ``["all-linear"]`` (every linear but ``lm_head``) or module
        names, matched as PEFT does (the whole name, or its last dotted components)."""
        if rank <= 0:
            return []
        every = list(targets) == ["all-linear"]
        out = []
        for name, fan_in, fan_out in self.linear_layers():
            if every or any(name == t or name.endswith("." + t) for t in targets):
                out += [(f"{name}.lora_A.default.weight", (rank, fan_in)),
                        (f"{name}.lora_B.default.weight", (fan_out, rank))]
        return out

    @property
    def num_params(self) -> int:
        return sum(_numel(s) for _, s in self.tensors())

    @property
    def layer_params(self) -> int:
        return sum(_numel(s) for _, s in self.layer_tensors(0))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token: 2 * L * n_kv * d_head * bytes (56 KiB for Qwen2.5-7B in bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def text_config(self, layers: Optional[int] = None) -> dict[str, Any]:
        """A plain decoder config of the same text shape (for tracing; ``layers`` overrides the depth)."""
        family = decoder_family(self.model_type)
        return dict(model_type=family, hidden_size=self.hidden, num_hidden_layers=layers or self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    intermediate_size=self.intermediate, vocab_size=self.vocab, tie_word_embeddings=self.tied,
                    attention_bias=self.qkv_bias or self.o_bias, mlp_bias=self.mlp_bias,
                    max_position_embeddings=max(32768, self.raw.get("max_position_embeddings", 0)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def numel(shape: tuple[int, ...]) -> int:
    return _numel(shape)
