"""The text-only causal-LM family: every Hugging Face decoder (Qwen2, Llama, ...); positions
count real tokens and there are no extra inputs (the base :class:`ModelInputs`). Its decoders'
layouts (:data:`DECODERS`) are also the language models of the vision-language families."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from fitrl.config.schema import ModelConfig
from fitrl.core.model_types import decoder_family
from fitrl.models.decoder import DecoderLayout, DenseLayout, MoeLayout
from fitrl.models.families.base import DTYPES, HEADS, MODEL_FAMILIES, Builder, ModelFamily, auto_builders

QWEN3_MOE_DEFAULTS = (("num_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 768),
                      ("decoder_sparse_step", 1), ("norm_topk_prob", False))
"""``Qwen3MoeConfig``'s values of the keys a ``config.json`` may leave out (transformers 5.x): the
model is built with them, so the plan reads them too."""

DECODERS: dict[str, DecoderLayout] = {
    "qwen2": DenseLayout(qkv_bias=True),             # q, k, v always biased
    "qwen3": DenseLayout(qk_norm=True),              # q/k RMSNorm per head
    "llama": DenseLayout(o_bias_from_config=True),   # attention_bias biases o_proj too
    "mistral": DenseLayout(o_bias_from_config=True),
    # Qwen3's attention (attention_bias biases all four projections), top-k routed experts
    "qwen3_moe": MoeLayout(qk_norm=True, o_bias_from_config=True, defaults=QWEN3_MOE_DEFAULTS,
                           aliases=(("num_experts", "num_local_experts"),)),
}
"""Each decoder family's layout (the ``decoder`` of a row of fitrl/core/model_types.py): what the
memory plan and the FLOP counter add to its ``config.json`` (fitrl/models/decoder.py)."""


class CausalLMFamily(ModelFamily):
    """``AutoModelForCausalLM`` for the policy, ``AutoModelForTokenClassification`` (one label)
    for the value model, ``AutoModelForSequenceClassification`` (one label) for a reward model; one FSDP unit per decoder layer; positions count real tokens."""

    name = "causal_lm"

    def builders(self, head: str, model: ModelConfig) -> tuple[Builder, Builder]:
        if head == "causal_lm":
            return auto_builders("AutoModelForCausalLM", model)
        if head == "value":
            return _value_model_builders(model)
        if head == "reward":  # the score at each sequence's last token (fitrl/roles/model_reward.py)
            return auto_builders("AutoModelForSequenceClassification", model, num_labels=1)
        raise ValueError(f"unknown model head {head!r}; valid: {', '.join(HEADS)}")

    def blocks_to_shard(self, model: nn.Module) -> list[nn.Module]:
        base = getattr(model, model.base_model_prefix, model) if hasattr(model, "base_model_prefix") else model
        layers = getattr(base, "layers", None)
        if layers is None:
            raise ValueError(f"cannot find decoder layers in {type(model).__name__}: FSDP needs one unit per layer")
        return list(layers)

    def decoder_layout(self, model_type: str) -> Optional[DecoderLayout]:
        return DECODERS.get(decoder_family(model_type))


CAUSAL_LM = CausalLMFamily()
MODEL_FAMILIES.add(CAUSAL_LM.name, CAUSAL_LM)


def _value_model_builders(model: ModelConfig) -> tuple[Builder, Builder]:
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model.path, num_labels=1, local_files_only=True)
    # From a causal-LM checkpoint the backbone loads and the one-output ``score`` head starts
    # random; dropout off so values are deterministic functions of the weights.
    config.classifier_dropout = 0.0
    kwargs = dict(dtype=DTYPES[model.dtype], attn_implementation=model.attn_implementation)

    def from_pretrained() -> nn.Module:
        # the new ``score`` head is expected to be missing from a causal-LM checkpoint: do not
        # print transformers' "newly initialized" report for it
        report = logging.getLogger("transformers.modeling_utils")
        drop = _DropLoadReport()
        report.addFilter(drop)
        try:
            return AutoModelForTokenClassification.from_pretrained(model.path, config=config, local_files_only=True,
                                                                   **kwargs)
        finally:
            report.removeFilter(drop)

    def from_config() -> nn.Module:
        return AutoModelForTokenClassification.from_config(config, **kwargs)
    return from_pretrained, from_config


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()
