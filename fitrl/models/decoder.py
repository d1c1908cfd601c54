"""A text decoder as its family describes it: every layer's tensors, the KV cache per token and
the FLOPs per token, in closed form from ``config.json``.

Two steps, as a family and a checkpoint split the facts between them:

- a :class:`DecoderLayout` is what the family knows and ``config.json`` does not say (Qwen2's
  q/k/v projections are always biased, Qwen3 normalises each head's q and k, Llama's
  ``attention_bias`` biases ``o_proj`` too) and the layout's kind: ``dense`` or ``moe``
  (fitrl/core/model_types.py, ``DECODER_KINDS``). A family hands one out per model type it claims
  (``ModelFamily.decoder_layout``; the text families' are in fitrl/models/families/causal_lm.py).
- :meth:`DecoderLayout.read` turns it and a text config into a sized :class:`Decoder`, what
  :class:`fitrl.models.shape.ModelShape` (the memory plan) and :class:`fitrl.models.flops.FlopsShape`
  (the FLOP counter) ask.

Only the dense kind is described here. A mixture-of-experts row has no layout yet, so
fitrl/trainer/complete.py reports it and ``ModelShape.from_dict`` refuses to plan it, rather than
planning it as a dense model; a MoE decoder is a second layout class beside :class:`DenseLayout`.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

Tensors = list[tuple[str, tuple[int, ...]]]

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""``config.json`` keys that count a mixture of experts' routed experts (Qwen-MoE, Mixtral, DeepSeek)."""


def experts_in(text: dict[str, Any]) -> Optional[tuple[str, int]]:
    """``(key, count)`` when a text config describes a mixture of experts, else None."""
    return next(((k, text[k]) for k in EXPERT_KEYS if text.get(k)), None)


class Decoder(Protocol):
    """What the memory plan and the FLOP counter ask of a sized text decoder (one ``config.json``)."""

    kind: str          # "dense" | "moe"
    hidden: int
    layers: int
    heads: int         # query heads
    kv_heads: int      # key-value heads (GQA: fewer than the query heads)
    head_dim: int
    intermediate: int  # the MLP's width (what the activation formulas of fitrl/memory/passes.py read)

    def layer_tensors(self, i: int) -> Tensors:
        """Every parameter of decoder layer ``i``, named as the transformers module names it."""

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token."""

    def linear_macs_per_token(self) -> int:
        """MACs of every layer's projections for one token (no attention scores, no head)."""

    def attention_macs(self, seq_len: int) -> int:
        """Q.K^T and A.V over a causal sequence of ``seq_len`` tokens, all layers."""

    def config(self, layers: int) -> dict[str, Any]:
        """The decoder's own ``config.json`` keys, ``layers`` deep (the memory trace builds a model
        from them: fitrl/memory/trace.py)."""


class DecoderLayout(Protocol):
    """What a family knows of its decoder beyond ``config.json``: its kind, and how to size it."""

    kind: str

    def read(self, text: dict[str, Any]) -> Decoder:
        """The decoder of a text config (a KeyError names a missing key)."""


@dataclass(frozen=True)
class DenseLayout:
    """A dense decoder layer: pre-norm attention (GQA) then a gated SwiGLU MLP; these flags are
    what a family adds to ``config.json``'s ``attention_bias`` and ``mlp_bias``."""

    kind: ClassVar[str] = "dense"
    qkv_bias: bool = False            # q, k, v always biased, whatever attention_bias says (Qwen2)
    o_bias_from_config: bool = False  # attention_bias biases o_proj as well as q, k, v (Llama, Mistral)
    qk_norm: bool = False             # an RMSNorm over each head's q and k (Qwen3)

    def read(self, text: dict[str, Any]) -> "DenseDecoder":
        h, heads = text["hidden_size"], text["num_attention_heads"]
        attention_bias = bool(text.get("attention_bias", False))
        return DenseDecoder(
            hidden=h, layers=text["num_hidden_layers"], heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads, head_dim=text.get("head_dim") or h // heads,
            intermediate=text["intermediate_size"], qkv_bias=self.qkv_bias or attention_bias,
            o_bias=self.o_bias_from_config and attention_bias, mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=self.qk_norm)


@dataclass(frozen=True)
class DenseDecoder:
    """A sized dense decoder (:class:`DenseLayout` over one text config); the FLOPs formula is
    fitrl/models/flops.py's (docs/metrics.md, "Model FLOPs")."""

    kind: ClassVar[str] = "dense"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def layer_tensors(self, i: int) -> Tensors:
        h, d, inter = self.hidden, self.head_dim, self.intermediate
        q, kv = self.heads * d, self.kv_heads * d
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

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """2 * L * n_kv * d_head * bytes (56 KiB for Qwen2.5-7B in bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def linear_macs_per_token(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention_proj = h * q + 2 * h * kv + q * h      # q, k, v, o
        mlp = 3 * h * self.intermediate                  # gate, up, down
        return self.layers * (attention_proj + mlp)

    def attention_macs(self, seq_len: int) -> int:
        """Sum over t = 1..S of 2 t n_q d = S (S + 1) n_q d per layer."""
        return self.layers * seq_len * (seq_len + 1) * self.heads * self.head_dim

    def config(self, layers: int) -> dict[str, Any]:
        return dict(hidden_size=self.hidden, num_hidden_layers=layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
                    attention_bias=self.qkv_bias or self.o_bias, mlp_bias=self.mlp_bias)


PLAIN_DENSE = DenseLayout()
"""A dense decoder with nothing beyond its config: how the FLOP counter reads a text model type
outside fitrl/core/model_types.py (transformers runs it; the memory plan refuses it)."""
