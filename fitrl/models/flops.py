"""Model FLOPs from a Hugging Face ``config.json``: what one token, one sequence, one image costs.

Pure arithmetic (the shape is read through the model families, which import torch). The formula
(docs/metrics.md, "Model FLOPs") counts the matrix multiplications of a dense decoder or of a
mixture of experts' active parameters and, for Qwen2-VL / Qwen2.5-VL, of its vision tower; a
multiply-add (MAC) is 2 FLOPs. Norms, activations,
softmax, rotary embeddings, biases and the embedding lookup are O(hidden) per token and left out,
as every MFU convention does.

Per token, per layer of a dense decoder (counted by its description, fitrl/models/decoder.py;
h = hidden, d = head_dim, n_q / n_kv = query / key-value heads, I = MLP intermediate width):

    q_proj  h x n_q*d        k_proj, v_proj  h x n_kv*d each (GQA: fewer key-value heads)
    o_proj  n_q*d x h        gate, up, down  h x I each (gated SwiGLU: three matrices)

A mixture of experts' sparse layer (fitrl/models/decoder.py, ``MoeDecoder``) replaces the MLP by
what one token runs: the router (h x E, E = ``num_experts``) and its k = ``num_experts_per_tok``
experts' gate, up and down (h x I_e each, I_e = ``moe_intermediate_size``), so FLOPs follow the
active parameters, not all experts' (Qwen3-30B-A3B: 3.0e9 of its 30.5e9 outside the embedding).

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

from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

from fitrl.models.shape import ModelShape


@dataclass(frozen=True)
class FlopsShape(ModelShape):
    """A model's shape (:class:`~fitrl.models.shape.ModelShape`, the memory plan's too: one reading
    of ``config.json``) with the FLOPs formula over it; the vision tower's is
    :meth:`~fitrl.models.vision.VisionTower.forward_flops`."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "FlopsShape":
        """From a ``config.json`` dict, read as :class:`~fitrl.models.shape.ModelShape` reads it
        (the memory plan's shape: one reading for both). Raises ValueError for what no decoder
        layout describes (a config that routes experts under a dense one, a missing key)."""
        model_type = cfg.get("model_type", "")
        try:
            return cls.of(ModelShape.from_dict(cfg, strict=False))  # transformers may run types the planner does not
        except KeyError as e:
            raise ValueError(f"config.json of model_type {model_type!r} has no {e.args[0]!r}") from None

    @classmethod
    def from_path(cls, path) -> "FlopsShape":
        """From a model directory (or its ``config.json``)."""
        return cls.from_config(ModelShape.read_config(path))

    @classmethod
    def of(cls, shape: ModelShape) -> "FlopsShape":
        return cls(**{f.name: getattr(shape, f.name) for f in fields(shape)})

    # ------------------------------------------------------------------ per token (the decoder's own count)
    def linear_macs_per_token(self) -> int:
        """MACs of every decoder layer's projections for one token (no attention scores, no head)."""
        return self.decoder.linear_macs_per_token()

    def head_macs_per_token(self) -> int:
        return self.hidden * self.vocab

    def attention_macs(self, seq_len: int) -> int:
        """Q.K^T and A.V over a causal sequence of ``seq_len`` tokens, all layers:
        sum over t = 1..S of 2 t n_q d = S (S + 1) n_q d per layer."""
        return self.decoder.attention_macs(seq_len)

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
