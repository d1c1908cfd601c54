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

Two kinds: :class:`DenseLayout` (one MLP per layer) and :class:`MoeLayout` (a router over
routed experts on its sparse layers, Qwen3-MoE's). A row of another kind than its family's layout
is reported by fitrl/trainer/complete.py and refused by ``ModelShape.from_dict``, as is a
``config.json`` that routes experts under a dense layout: never planned as something else.
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

    def parameter_adapters(self, i: int, rank: int, targets: list[str]) -> Tensors:
        """PEFT's LoRA adapters on layer ``i``'s parameters that are no ``nn.Linear``'s weight
        (a mixture of experts' stacked experts), for ``targets`` as ``actor.lora.target_modules``
        names them; the linear layers' adapters are :meth:`fitrl.models.shape.ModelShape.lora_tensors`'."""

    def adapts(self, module: str) -> bool:
        """Whether PEFT puts an adapter on the targeted linear layer ``module`` (a full name)."""

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
        h, inter = self.hidden, self.intermediate
        p = f"model.layers.{i}."
        out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += _attention_tensors(self, p, self.qkv_bias, self.o_bias, self.qk_norm)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out.append((p + f"mlp.{name}.weight", shape))
            if self.mlp_bias:
                out.append((p + f"mlp.{name}.bias", (shape[0],)))
        return out

    def parameter_adapters(self, i: int, rank: int, targets: list[str]) -> Tensors:
        return []  # every parameter with an adapter is a linear layer's

    def adapts(self, module: str) -> bool:
        return True

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """2 * L * n_kv * d_head * bytes (56 KiB for Qwen2.5-7B in bf16)."""
        return _kv_bytes(self, dtype_bytes)

    def linear_macs_per_token(self) -> int:
        mlp = 3 * self.hidden * self.intermediate        # gate, up, down
        return self.layers * (_attention_proj_macs(self) + mlp)

    def attention_macs(self, seq_len: int) -> int:
        """Sum over t = 1..S of 2 t n_q d = S (S + 1) n_q d per layer."""
        return _score_macs(self, seq_len)

    def config(self, layers: int) -> dict[str, Any]:
        return dict(hidden_size=self.hidden, num_hidden_layers=layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
                    attention_bias=self.qkv_bias or self.o_bias, mlp_bias=self.mlp_bias)


PLAIN_DENSE = DenseLayout()
"""A dense decoder with nothing beyond its config: how the FLOP counter reads a text model type
outside fitrl/core/model_types.py (transformers runs it; the memory plan refuses it)."""


@dataclass(frozen=True)
class MoeLayout:
    """A mixture-of-experts decoder (Qwen3-MoE): the dense layer's attention, then on its sparse
    layers a router over ``num_experts`` experts, each a gated SwiGLU MLP ``moe_intermediate_size``
    wide, ``num_experts_per_tok`` of them run per token; the other layers (``mlp_only_layers``, and
    those ``decoder_sparse_step`` skips) keep a dense MLP ``intermediate_size`` wide. Beside the
    dense flags: a shared expert run on every token (Qwen2-MoE's, gated by one sigmoid), and the
    defaults of the family's config class for the MoE keys a ``config.json`` may leave out (the
    model takes them, so the plan must: ``(key, value)`` pairs) and the other names it saves a key
    under (``(key, alias)``: transformers 5 writes Qwen3-MoE's ``num_experts`` as
    ``num_local_experts``, its ``attribute_map``)."""

    kind: ClassVar[str] = "moe"
    qkv_bias: bool = False
    o_bias_from_config: bool = False
    qk_norm: bool = False
    shared_expert: bool = False
    defaults: tuple[tuple[str, Any], ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()

    def read(self, text: dict[str, Any]) -> "MoeDecoder":
        defaults = dict(self.defaults)

        def key(name: str) -> Any:
            for k in (name, *(alias for n, alias in self.aliases if n == name)):
                if text.get(k) is not None:
                    return text[k]
            return defaults[name]

        h, heads = text["hidden_size"], text["num_attention_heads"]
        attention_bias = bool(text.get("attention_bias", False))
        experts, top_k = key("num_experts"), key("num_experts_per_tok")
        if experts and not 0 < top_k <= experts:
            raise ValueError(f"config.json routes each token to num_experts_per_tok={top_k} of num_experts={experts} "
                             f"experts: it must be between 1 and the experts")
        return MoeDecoder(
            hidden=h, layers=text["num_hidden_layers"], heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads, head_dim=text.get("head_dim") or h // heads,
            dense_intermediate=text["intermediate_size"], experts=experts, top_k=top_k,
            expert_intermediate=key("moe_intermediate_size"), sparse_step=key("decoder_sparse_step"),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            shared_intermediate=key("shared_expert_intermediate_size") if self.shared_expert else 0,
            qkv_bias=self.qkv_bias or attention_bias, o_bias=self.o_bias_from_config and attention_bias,
            qk_norm=self.qk_norm, norm_topk_prob=bool(key("norm_topk_prob")))


@dataclass(frozen=True)
class MoeDecoder:
    """A sized mixture-of-experts decoder (:class:`MoeLayout` over one text config). Its tensors
    are what the transformers module holds (every expert: the memory plan's weights, gradients and
    optimizer states count them all), its FLOPs what one token runs (the router and its top-k
    experts: the active parameters), its KV cache the dense layer's."""

    kind: ClassVar[str] = "moe"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_intermediate: int       # intermediate_size: the MLP of a layer that routes nothing
    experts: int                  # num_experts (routed)
    top_k: int                    # num_experts_per_tok
    expert_intermediate: int      # moe_intermediate_size: one expert's MLP width
    sparse_step: int = 1          # decoder_sparse_step: layer i routes when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    shared_intermediate: int = 0  # shared_expert_intermediate_size; 0: no shared expert
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_topk_prob: bool = False

    def sparse(self, i: int) -> bool:
        """Layer ``i`` routes its tokens to experts (as transformers' ``Qwen3MoeDecoderLayer`` decides)."""
        return i not in self.mlp_only_layers and self.experts > 0 and (i + 1) % self.sparse_step == 0

    @property
    def sparse_layers(self) -> int:
        return sum(self.sparse(i) for i in range(self.layers))

    @property
    def stacked_expert_params(self) -> int:
        """The routed experts' parameters, every sparse layer's 3-D ``gate_up_proj`` and
        ``down_proj``: what transformers 5 stacks at load time from a checkpoint's per-expert
        matrices (the layout it also saves), into new tensors (fitrl/memory/mapped.py)."""
        return self.sparse_layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def routed_ids_per_token(self) -> int:
        """A sampled token's recorded experts, ``top_k`` per sparse layer (the batch's
        ``routed_experts``, int16: fitrl/models/moe_routing.py)."""
        return self.sparse_layers * self.top_k

    @property
    def intermediate(self) -> int:
        """The widest MLP a token goes through: its top-k experts' (and the shared expert's) on a
        sparse layer, the dense MLP elsewhere (8 x 768 = 6144 for Qwen3-30B-A3B)."""
        widths = [self.top_k * self.expert_intermediate + self.shared_intermediate] if self.sparse_layers else []
        return max(widths + ([self.dense_intermediate] if self.sparse_layers < self.layers else []))

    def layer_tensors(self, i: int) -> Tensors:
        h, e = self.hidden, self.expert_intermediate
        p = f"model.layers.{i}."
        out = _attention_tensors(self, p, self.qkv_bias, self.o_bias, self.qk_norm)
        if self.sparse(i):  # every expert's gate and up stacked in one 3-D parameter, down in another
            out += [(p + "mlp.experts.gate_up_proj", (self.experts, 2 * e, h)),
                    (p + "mlp.experts.down_proj", (self.experts, h, e)),
                    (p + "mlp.gate.weight", (self.experts, h))]
            if self.shared_intermediate:
                out += _mlp_tensors(p + "mlp.shared_expert.", h, self.shared_intermediate)
                out.append((p + "mlp.shared_expert_gate.weight", (1, h)))
        else:
            out += _mlp_tensors(p + "mlp.", h, self.dense_intermediate)
        return out + [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]

    def parameter_adapters(self, i: int, rank: int, targets: list[str]) -> Tensors:
        """As PEFT 0.21 adapts the stacked experts (checked against it in tests/test_moe_decoder.py):
        ``all-linear`` or the per-expert names of transformers 4 (``gate_proj`` with ``up_proj``,
        ``down_proj``) target the 3-D ``gate_up_proj`` (rank doubled: two fused matrices) and
        ``down_proj``; a parameter of E stacked (out, in) matrices gets ``lora_A`` (r E, in) and
        ``lora_B`` (out, r E). With both, PEFT nests the first wrapper under ``base_layer``. The
        same mapping takes those names away from the module targets: :meth:`adapts`."""
        if not self.sparse(i):
            return []
        every = list(targets) == ["all-linear"]

        def named(name: str) -> bool:
            return every or any(t == name or t.endswith("." + name) for t in targets)

        h, e, n = self.hidden, self.expert_intermediate, self.experts
        wrapped = [(2 * rank, 2 * e, h)] if named("gate_proj") and named("up_proj") else []
        wrapped += [(rank, h, e)] if named("down_proj") else []
        p = f"model.layers.{i}.mlp.experts."
        out = []
        for k, (r, rows, cols) in enumerate(wrapped):
            at = p + "base_layer." * (len(wrapped) - 1 - k)
            out += [(at + "lora_A.default.weight", (r * n, cols)), (at + "lora_B.default.weight", (rows, r * n))]
        return out

    def adapts(self, module: str) -> bool:
        """Not a dense layer's ``mlp.gate_proj``, ``up_proj`` or ``down_proj``: PEFT 0.21 turns those
        targets into the experts' parameters, and ``all-linear`` as well."""
        return not module.endswith((".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return _kv_bytes(self, dtype_bytes)

    def linear_macs_per_token(self) -> int:
        """Attention's projections on every layer; on a sparse layer the router (h x E), top-k
        experts' gate, up and down, the shared expert and its gate; the dense MLP elsewhere."""
        h, sparse = self.hidden, self.sparse_layers
        routed = self.experts * h + self.top_k * 3 * h * self.expert_intermediate
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        dense = 3 * h * self.dense_intermediate
        return self.layers * _attention_proj_macs(self) + sparse * (routed + shared) + (self.layers - sparse) * dense

    def attention_macs(self, seq_len: int) -> int:
        return _score_macs(self, seq_len)

    def config(self, layers: int) -> dict[str, Any]:
        """The traced model routes on every layer when any does (a mixed decoder's dense layers are
        traced as sparse ones: fitrl/memory/trace.py extrapolates one kind of layer)."""
        out = dict(hidden_size=self.hidden, num_hidden_layers=layers, num_attention_heads=self.heads,
                   num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.dense_intermediate,
                   attention_bias=self.qkv_bias or self.o_bias, num_experts=self.experts if self.sparse_layers else 0,
                   num_experts_per_tok=self.top_k, moe_intermediate_size=self.expert_intermediate,
                   decoder_sparse_step=1, norm_topk_prob=self.norm_topk_prob)
        if self.shared_intermediate:
            out.update(shared_expert_intermediate_size=self.shared_intermediate, qkv_bias=self.qkv_bias)
        return out


# ---------------------------------------------------------------------------- shared by both kinds
def _attention_tensors(d: Decoder, p: str, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> Tensors:
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = []
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((p + f"self_attn.{name}.weight", (rows, h)))
        if qkv_bias:
            out.append((p + f"self_attn.{name}.bias", (rows,)))
    out.append((p + "self_attn.o_proj.weight", (h, q)))
    if o_bias:
        out.append((p + "self_attn.o_proj.bias", (h,)))
    if qk_norm:
        out += [(p + "self_attn.q_norm.weight", (d.head_dim,)), (p + "self_attn.k_norm.weight", (d.head_dim,))]
    return out


def _mlp_tensors(p: str, h: int, inter: int) -> Tensors:
    return [(p + "gate_proj.weight", (inter, h)), (p + "up_proj.weight", (inter, h)), (p + "down_proj.weight", (h, inter))]


def _attention_proj_macs(d: Decoder) -> int:
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    return h * q + 2 * h * kv + q * h  # q, k, v, o


def _kv_bytes(d: Decoder, dtype_bytes: int) -> int:
    return 2 * d.layers * d.kv_heads * d.head_dim * dtype_bytes


def _score_macs(d: Decoder, seq_len: int) -> int:
    return d.layers * seq_len * (seq_len + 1) * d.heads * d.head_dim
