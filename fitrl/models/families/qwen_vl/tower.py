"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers in closed form: every parameter tensor, the
forward FLOPs of one image, and the largest image the processor emits (the memory plan's and the
FLOP counter's one description of a tower: :class:`fitrl.models.vision.VisionTower`).

:func:`tower_from_config` reads ``config.json``'s ``vision_config`` with transformers' defaults
for the keys a checkpoint leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from fitrl.data.images import MAX_ASPECT_RATIO
from fitrl.models.vision import VisualInput


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

    def activation_widths(self, grad: bool, checkpointing: bool) -> tuple[tuple[int, int], ...]:
        """``(count, width)`` of the activation tensors, each ``patches x width`` in the compute
        dtype, that one pass of the tower holds at its peak (the memory plan's
        ``vision_activations``). Per patch: saved for backward ``14e + 4I`` per block (e the
        tower's width, I its MLP's), or with checkpointing ``2e`` per block plus one block's
        ``14e + 4I`` recomputed in backward; without grad (log-probs, generation, a frozen tower)
        one block's working set ``4e + 2I``.

        ``14e + 4I`` is measured: the distinct tensors a Qwen2.5-VL vision block saves for backward
        (transformers' block, SDPA; ``bench/vl_image_memory.py --vision-block``), per patch: 932,
        3718 and 30338 elements in fp32 and 1000, 3980 and 32916 in bf16 at (e, I) = (32, 128),
        (128, 512) and (1280, 3420) (Qwen2.5-VL-7B's), within 4.2% of 14e + 4I (norms, qkv, rotary
        q and k, attention output, projection input; the SwiGLU MLP's gate, up, activation and
        product). The earlier ``12e + 8I`` counted the MLP twice (+30-41% at the 7B's widths). On
        CPU (``bench/vl_image_memory.py``, 2048 x 2048 pictures, ``MALLOC_MMAP_THRESHOLD_``) an
        update's tower measured 0.70 GiB for 0.61 planned: the patch embedding, rotary tables and
        merger outside the blocks (5-6e per patch, measured) are not counted. With checkpointing a
        block saves its input only (e per patch, measured) besides what its backward recomputes:
        ``2e`` is kept as a margin for the gradient flowing through (not measured as a peak)."""
        e, i = self.hidden, self.intermediate
        if not grad:
            return (4, e), (2, i)
        if checkpointing:
            return (2 * self.depth + 14, e), (4, i)
        return (14 * self.depth, e), (4 * self.depth, i)

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

    def largest_image(self, max_pixels: int, min_pixels: int = 0) -> VisualInput:
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


def tower_from_config(cfg: dict[str, Any]) -> VisionShape:
    """The tower of a Qwen-VL ``config.json`` (as a dict); the language model's hidden size is
    the merger's output width when ``vision_config`` does not say it."""
    mt, v = cfg["model_type"], cfg["vision_config"]
    h = (cfg.get("text_config") or cfg)["hidden_size"]
    if mt == "qwen2_vl":
        e = v.get("embed_dim", 1280)
        return VisionShape(mt, v["depth"], e, int(e * v.get("mlp_ratio", 4)), v.get("hidden_size", h),
                           v.get("patch_size", 14), v.get("temporal_patch_size", 2),
                           v.get("spatial_merge_size", 2), v.get("in_chans", v.get("in_channels", 3)))
    if mt == "qwen3_vl":  # transformers' Qwen3VLVisionConfig defaults
        return VisionShape(mt, v.get("depth", 27), v.get("hidden_size", 1152),
                           v.get("intermediate_size", 4304), v.get("out_hidden_size", h),
                           v.get("patch_size", 16), v.get("temporal_patch_size", 2),
                           v.get("spatial_merge_size", 2),
                           v.get("in_channels", 3), v.get("num_position_embeddings", 2304),
                           len(v.get("deepstack_visual_indexes", (8, 16, 24))))
    window, patch = v.get("window_size"), v.get("patch_size", 14)
    return VisionShape(mt, v["depth"], v["hidden_size"], v["intermediate_size"],
                       v.get("out_hidden_size", h), patch,
                       v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2),
                       v.get("in_chans", v.get("in_channels", 3)),
                       window_patches=(window // patch) ** 2 if window else None,
                       full_attention_blocks=len(v.get("fullatt_block_indexes", [])))
