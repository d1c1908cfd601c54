"""Model FLOPs from a Hugging Face ``config.json``: what one token, one sequence, one image costs.

Pure arithmetic, no torch. The formula (docs/metrics.md, "Model FLOPs") counts the matrix
multiplications of a dense decoder and, for Qwen2-VL / Qwen2.5-VL, of its vision tower; a
multiply-add (MAC) is 2 FLOPs. Norms, activations, softmax, rotary embeddings, biases and the
embedding lookup are O(hidden) per token and left out, as every MFU convention does.

Per token, per decoder layer (h = hidden, d = head_dim, n_q / n_kv = query / key-value heads,
I = MLP intermediate width):

    q_proj  h x n_q*d        k_proj, v_proj  h x n_kv*d each (GQA: fewer key-value heads)
    o_proj  n_q*d x h        gate, up, down  h x I each (gated SwiGLU: three matrices)

plus attention itself: the token at position t (1-based) attends t keys (causal), so Q.K^T
and the weighted sum over V cost t * n_q * d MACs each. Summed over a sequence of S tokens
that is ``S (S + 1) n_q d`` MACs per layer (the exact causal count: PaLM and veRL count the full
``S^2`` square, which gives a larger figure for long sequences).

The output head (h x vocab) is counted once per *response* token: only those positions' log-probs
are computed (fitrl/ops/logprob.py), and generation reads one distribution per new token. It
costs the same whether or not the embeddings are tied (tying shares the weight, not the work).

Forward = 2 x MACs. Backward = 2 x forward (activation gradients and weight gradients, each a
matmul of the forward's size), so full training is 3 x forward. With LoRA the frozen base has
no weight gradients: its linear layers cost 1 x forward in backward (activation gradients
only) while attention's score/value matmuls, which have no weights, still cost 2 x; the
adapters' own matmuls (r x (in + out) per adapted layer, under 1 % at r=16 on a 4096-wide model)
are left out. Gradient checkpointing's recomputed forward is not counted (model FLOPs, not
hardware FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

VISION_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VisionFlopsShape:
    """A Qwen2-VL / Qwen2.5-VL vision tower, as far as its matmuls go.

    ``qwen2_vl`` (vision_config keys): ``embed_dim`` (ViT width), ``mlp_ratio`` (MLP = fc1, fc2),
    ``num_heads``, ``depth``, ``hidden_size`` (the merger's output: the language model's width);
    every block attends over the whole image.
    ``qwen2_5_vl``: ``hidden_size`` (ViT width), ``intermediate_size`` (gated MLP: gate, up,
    down), ``out_hidden_size`` (merger output), ``window_size`` (pixels) and
    ``fullatt_block_indexes``: the other blocks attend within windows of
    ``(window_size / patch_size)^2`` patches.
    ``qwen3_vl``: ``hidden_size``, ``intermediate_size`` (MLP = fc1, fc2), ``out_hidden_size``,
    ``patch_size`` 16, and one more merger per ``deepstack_visual_indexes`` entry (their outputs
    are added to the first decoder layers' hidden states); every block attends over the image.
    All: ``patch_size`` 14 (16), ``temporal_patch_size`` 2, ``spatial_merge_size`` 2 (2 x 2 patches
    become one language-model token through a 2-layer MLP merger), ``in_chans`` 3.
    """

    kind: str
    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    in_chans: int = 3
    window_patches: Optional[int] = None  # qwen2_5_vl: patches per attention window
    full_attention_blocks: int = 0         # qwen2_5_vl: blocks attending over the whole image
    mergers: int = 1                       # qwen3_vl: 1 + its deepstack mergers

    @property
    def gated_mlp(self) -> bool:
        return self.kind == "qwen2_5_vl"

    def forward_flops(self, patches: int) -> int:
        """Forward FLOPs of the tower over one image (or video) of ``patches`` patches, merger
        included. Attention is non-causal within an image: each patch attends all of them
        (or its window's)."""
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
        macs = patches * (embed + self.depth * block_linear) + patches * attention + self.mergers * merged * merger
        return 2 * macs


@dataclass(frozen=True)
class FlopsShape:
    """The dimensions the FLOPs formula needs, from ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vision: Optional[VisionFlopsShape] = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "FlopsShape":
        """From a ``config.json`` dict. Raises ValueError for what the dense formula does not
        describe (a mixture of experts, a missing key)."""
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config") or cfg
        experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if text.get(k)]
        if experts:
            raise ValueError(f"model_type {model_type!r} is a mixture of experts ({experts[0]}="
                             f"{text[experts[0]]}); the FLOPs formula is for dense decoders")
        try:
            h, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            vision = _vision_shape(model_type, cfg["vision_config"], h) if model_type in VISION_TYPES else None
            return cls(hidden=h, layers=int(text["num_hidden_layers"]), heads=heads,
                       kv_heads=int(text.get("num_key_value_heads") or heads),
                       head_dim=int(text.get("head_dim") or h // heads),
                       intermediate=int(text["intermediate_size"]),
                       vocab=int(text.get("vocab_size") or cfg["vocab_size"]), vision=vision)
        except KeyError as e:
            raise ValueError(f"config.json of model_type {model_type!r} has no {e.args[0]!r}") from None

    # ------------------------------------------------------------------ per token
    def linear_macs_per_token(self) -> int:
        """MACs of every decoder layer's projections for one token (no attention scores, no head)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention_proj = h * q + 2 * h * kv + q * h      # q, k, v, o
        mlp = 3 * h * self.intermediate                  # gate, up, down
        return self.layers * (attention_proj + mlp)

    def head_macs_per_token(self) -> int:
        return self.hidden * self.vocab

    def attention_macs(self, seq_len: int) -> int:
        """Q.K^T and A.V over a causal sequence of ``seq_len`` tokens, all layers:
        sum over t = 1..S of 2 t n_q d = S (S + 1) n_q d per layer."""
        return self.layers * seq_len * (seq_len + 1) * self.heads * self.head_dim

    # ------------------------------------------------------------------ per sequence
    def forward_flops(self, prompt_len: int, response_len: int, image_patches: Iterable[int] = ()) -> int:
        """One forward over a prompt + response sequence (log-probs of the response; a
        generation with a KV cache does the same work), vision tower included."""
        seq = prompt_len + response_len
        macs = (seq * self.linear_macs_per_token() + self.attention_macs(seq)
                + response_len * self.head_macs_per_token())
        return 2 * macs + self.vision_flops(image_patches)

    def training_flops(self, prompt_len: int, response_len: int, image_patches: Iterable[int] = (),
                       lora: bool = False) -> int:
        """Forward + backward. Full: 3 x forward. LoRA: linear layers and head 2 x forward (no
        weight gradients for the frozen base), attention matmuls 3 x (no weights to skip); a
        frozen vision tower (no weight gradients) 2 x."""
        patches = list(image_patches)
        if not lora:
            return 3 * self.forward_flops(prompt_len, response_len, patches)
        seq = prompt_len + response_len
        weights = seq * self.linear_macs_per_token() + response_len * self.head_macs_per_token()
        return 2 * (2 * weights + 3 * self.attention_macs(seq)) + 2 * self.vision_flops(patches)

    def vision_flops(self, image_patches: Iterable[int]) -> int:
        if self.vision is None:
            return 0
        return sum(self.vision.forward_flops(p) for p in image_patches)

    # ------------------------------------------------------------------ batches
    def batch_forward_flops(self, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> int:
        return sum(self.forward_flops(p, r) for p, r in zip(prompt_lens, response_lens))

    def batch_training_flops(self, prompt_lens: Sequence[int], response_lens: Sequence[int],
                             lora: bool = False) -> int:
        return sum(self.training_flops(p, r, lora=lora) for p, r in zip(prompt_lens, response_lens))


def _vision_shape(model_type: str, v: dict[str, Any], text_hidden: int) -> VisionFlopsShape:
    common = dict(patch=v.get("patch_size", 14), temporal_patch=v.get("temporal_patch_size", 2),
                  merge=v.get("spatial_merge_size", 2), in_chans=v.get("in_chans", v.get("in_channels", 3)))
    if model_type == "qwen2_vl":
        # qwen2_vl's vision_config.hidden_size is the merger's output (the language model's width)
        e = v.get("embed_dim", 1280)
        return VisionFlopsShape(model_type, v["depth"], e, int(e * v.get("mlp_ratio", 4)),
                                v.get("hidden_size", text_hidden), **common)
    if model_type == "qwen3_vl":
        return VisionFlopsShape(model_type, v["depth"], v["hidden_size"], v["intermediate_size"],
                                v.get("out_hidden_size", text_hidden), **common,
                                mergers=1 + len(v.get("deepstack_visual_indexes", [])))
    window = v.get("window_size")
    return VisionFlopsShape(model_type, v["depth"], v["hidden_size"], v["intermediate_size"],
                            v.get("out_hidden_size", text_hidden), **common,
                            window_patches=(window // common["patch"]) ** 2 if window else None,
                            full_attention_blocks=len(v.get("fullatt_block_indexes", [])))
