"""Tiny random-initialised causal LMs, built entirely on this machine.

``make_tiny_model(out_dir, arch="qwen2", size="tiny", seed=0)`` writes a Hugging Face model
directory (config, ``model.safetensors``, ``generation_config.json``, tokenizer files) that loads
with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. Nothing is
downloaded: the tokenizer is a byte-level BPE trained here on a small built-in corpus
(arithmetic prompts, common English, chat-role words) in which every digit is its own token
(:mod:`fitrl.models.tiny_tokenizer`).

Two chat conventions are mimicked so that code is exercised against both:

* ``qwen2`` -- ChatML: ``<|im_start|>role\\n...<|im_end|>\\n``; eos ``<|im_end|>``, pad
  ``<|endoftext|>``, no BOS anywhere. ``AutoTokenizer`` returns ``Qwen2Tokenizer`` for this
  model type, which imposes Qwen2's own NFC + split regex (one digit per pre-token), so the
  tokenizer is trained with exactly that pipeline.
* ``llama`` -- Llama-3: ``<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``;
  the template renders the BOS, eos ``<|eot_id|>``, pad ``<|finetune_right_pad_id|>``. As with real
  Llama-3 tokenizers, plain ``tokenizer(text)`` prepends the BOS too, so text rendered by the chat
  template must be encoded with ``add_special_tokens=False``. Pre-tokenizer:
  ``Digits(individual_digits=True)`` then byte-level; ``AutoTokenizer`` loads tokenizer.json as is.

Both templates wrap assistant turns in ``{% generation %}`` so ``apply_chat_template(...,
return_assistant_tokens_mask=True, return_dict=True)`` works. Padding side is left at the HF default
(right), as in the real tokenizers: set ``tokenizer.padding_side = "left"`` for batched generation.

Three vision-language archs (``VL_ARCHS``) reuse the ``qwen2`` ChatML tokenizer plus Qwen's vision
tokens ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, and a template
that renders ``{"type": "image"}`` / ``{"type": "video"}`` content parts as
``<|vision_start|><|image_pad|><|vision_end|>`` (``<|video_pad|>``), as Qwen's does:

* ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` -- the decoder of the size row under ``text_config``
  with a multimodal rope (``mrope_section`` sums to head_dim / 2), a small vision tower
  (``VISION_SIZES``; patch 14, or 16 for Qwen3-VL; merge 2, temporal patch 2), the vision token
  ids of the tokenizer in the config, and the processor files (:func:`processor_configs`:
  ``preprocessor_config.json``, ``video_preprocessor_config.json``). They load with
  ``AutoModelForImageTextToText``, ``AutoTokenizer`` and ``AutoImageProcessor`` (which returns
  ``Qwen2VLImageProcessorPil`` without torchvision). ``AutoProcessor`` needs torchvision in
  transformers 5.23 (the Qwen-VL processors always build their torchvision-only video
  processor, even for images alone): without it, use the tokenizer and the image processor, and
  repeat each ``<|image_pad|>`` ``image_grid_thw.prod() // merge_size**2`` times, as the
  processor would. ``generate`` needs ``mm_token_type_ids`` (1 on image pads, 2 on video pads).

One mixture-of-experts arch (``MOE_ARCHS``), on the ``qwen2`` ChatML tokenizer:

* ``qwen3_moe`` -- the size row's decoder with every layer's MLP replaced by ``MOE_EXPERTS``: 4
  routed experts, 2 per token (top-k probabilities renormalised, as Qwen3-30B-A3B's
  ``norm_topk_prob``), each ``intermediate_size / 2`` wide, so a token's active MLP is the size's
  dense width (Qwen3-30B-A3B's 8 x 768 is its dense 6144 too). Loads with
  ``AutoModelForCausalLM``, as a real checkpoint does.

Same arguments give byte-identical weights and tokenizer files. The tokenizer does not depend on
``seed``, so models built with different seeds share one vocabulary.

``head_dim`` re-splits the size's attention width into heads of another size (:func:`head_dims`
lists the values): ``tiny``'s 4 heads of 16 (2 kv heads) become e.g. 2 heads of 32 (1 kv head), the
head sizes that vLLM's CPU attention supports (32, 64, ...; not 16). ``num_attention_heads *
head_dim`` stays ``hidden_size`` and the q/kv head ratio is kept where the heads allow it, so every
projection keeps its shape and, for a given seed, its weights (only Qwen3-VL's per-head q/k norms,
ones at initialisation, change length); the multimodal rope's sections are re-derived from the new
head_dim. Left out (or the size's own), nothing changes: same files, byte for byte.

Heavy imports (torch, transformers, tokenizers) happen inside the functions: importing this module
is cheap.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from fitrl.core.errors import ConfigError
from fitrl.models.tiny_tokenizer import build_corpus, build_tokenizer, pin_tokenizer_class
from fitrl.models.tiny_specs import ARCHS, MAX_POSITION_EMBEDDINGS, ROPE_PARAMETERS, ArchSpec
from fitrl.models.tiny_vl import VISION_SIZES, VISION_TOKENS, VL_ARCHS, _vl_config, _write_processor, processor_configs

__all__ = ["ARCHS", "MOE_ARCHS", "MOE_EXPERTS", "SIZES", "VL_ARCHS", "VISION_SIZES", "VISION_TOKENS", "make_tiny_model", "describe",
           "head_dims", "processor_configs", "build_corpus"]

# ---------------------------------------------------------------------------------------------
# Size table. Add a row to add a size; every key is passed to the HF config except ``vocab_size``,
# which is the BPE target (the model's vocab is ``len(tokenizer)``, whatever BPE reaches), and
# ``corpus``, the tokenizer's training text (default "base").
# ---------------------------------------------------------------------------------------------
_SIZE_COLUMNS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "tie_word_embeddings")


def _size(*values: Any, **extra: Any) -> dict[str, Any]:
    """One row of :data:`SIZES`: the values of ``_SIZE_COLUMNS`` in order, then any other key."""
    return dict(zip(_SIZE_COLUMNS, values, strict=True), **extra)


SIZES: dict[str, dict[str, Any]] = {
    #                hidden, layers, heads, kv heads, intermediate, vocab (the BPE target), tied
    "tiny":    _size(64,    2,  4,  2,  256,   512, True),
    "small":   _size(512,   8,  8,  4, 1408,  8192, False),
    # ~18M parameters: deeper and narrower than small, with twice its vocabulary (the logits weigh
    # more against the activations); the CPU memory corpus's third shape (bench/cpu_corpus.py)
    "deep":    _size(256,  12,  4,  2,  768, 16384, False),
    # ~0.7M parameters with a tokenizer trained on tool-calling conversations too (``corpus``, see
    # fitrl/models/tiny_tokenizer.py CORPORA): the agent example's model (examples/mul_tools.yaml),
    # wide enough to learn, in a few hundred supervised steps, to copy numbers from the question
    # into a call and from the tool's reply into the answer (tiny's 64 did not in 300)
    "agent":   _size(128,   2,  4,  2,  512,  1024, True, corpus="agent"),
    # ~0.2B parameters (0.8 GiB in fp32): big enough that loading, not process overhead,
    # dominates host memory in the rank-0 initialisation benchmark
    "medium":  _size(1024, 14, 16,  4, 2816,  8192, False),
}




MOE_ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": replace(ARCHS["qwen2"], config_class="Qwen3MoeConfig", model_class="Qwen3MoeForCausalLM"),
}
"""Mixture-of-experts archs: a text arch's tokenizer and chat template, a routed decoder."""

MOE_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
"""The tiny MoE's routing (``moe_intermediate_size`` is the size's ``intermediate_size`` divided
by the experts per token)."""


# ---------------------------------------------------------------------------------------------
# Builders.
# ---------------------------------------------------------------------------------------------
def _check(arch: str, size: str) -> tuple[ArchSpec, dict[str, Any]]:
    if arch in VL_ARCHS:
        if size not in VISION_SIZES:
            raise ValueError(f"size {size!r} has no vision tower; valid sizes for {arch}: {', '.join(VISION_SIZES)}")
        return VL_ARCHS[arch], dict(SIZES[size])
    text = {**ARCHS, **MOE_ARCHS}
    if arch not in text:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(sorted(text) + sorted(VL_ARCHS))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    size_cfg = dict(SIZES[size])
    if arch in MOE_ARCHS:
        width = size_cfg["intermediate_size"] // MOE_EXPERTS["num_experts_per_tok"]
        size_cfg.update(MOE_EXPERTS, moe_intermediate_size=width)
    return text[arch], size_cfg


def head_dims(arch: str, size: str) -> list[int]:
    """The ``head_dim`` values :func:`make_tiny_model` accepts for ``arch`` and ``size``: the even
    divisors of the size's hidden size (rope rotates pairs of channels; the heads fill the width
    exactly, so the projections keep their shapes) and, for a VL arch, those whose multimodal rope
    gives each of its t/h/w sections at least one frequency."""
    spec, size_cfg = _check(arch, size)
    hidden = size_cfg["hidden_size"]
    dims = [d for d in range(2, hidden + 1, 2) if hidden % d == 0]
    if spec.vision is not None:
        dims = [d for d in dims if min(spec.vision.mrope_section(d // 2)) > 0]
    return dims


def _split_heads(arch: str, size: str, size_cfg: dict[str, Any], head_dim: int | None) -> int | None:
    """Set ``size_cfg``'s head counts for ``head_dim``: ``hidden_size // head_dim`` heads, and kv
    heads keeping the size's q/kv ratio (the largest divisor of the heads at or under heads / ratio,
    at least 1: same k/v shapes whenever the ratio divides the heads). Returns ``head_dim``, or
    None where it is left out or the size's own (nothing changes). Raises ``ConfigError`` (a
    ``ValueError``) with one line naming the valid values."""
    if head_dim is None:
        return None
    own = size_cfg["hidden_size"] // size_cfg["num_attention_heads"]
    valid = head_dims(arch, size)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in valid:
        raise ConfigError(f"head_dim {head_dim!r} is not possible for {arch} size {size!r} (hidden_size "
                          f"{size_cfg['hidden_size']}, head_dim {own}): it must be an even divisor of the hidden "
                          f"size{' whose mrope sections are all positive' if arch in VL_ARCHS else ''}; "
                          f"valid: {', '.join(map(str, valid))}")
    if head_dim == own:
        return None
    ratio = size_cfg["num_attention_heads"] // size_cfg["num_key_value_heads"]
    heads = size_cfg["hidden_size"] // head_dim
    size_cfg["num_attention_heads"] = heads
    size_cfg["num_key_value_heads"] = max([d for d in range(1, heads + 1) if heads % d == 0 and d * ratio <= heads],
                                          default=1)
    return head_dim


def make_tiny_model(out_dir, arch: str = "qwen2", size: str = "tiny", seed: int = 0,
                    head_dim: int | None = None, head: str = "causal_lm") -> Path:
    """Write a random-initialised HF causal LM + tokenizer to ``out_dir`` and return its path.

    ``arch``: one of ``ARCHS`` (``qwen2``, ``llama``), ``MOE_ARCHS`` (``qwen3_moe``) or ``VL_ARCHS``
    (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: also the processor's files, see :func:`processor_configs`);
    ``size``: one of ``SIZES`` (``tiny``, ``small``, ``deep``, ``medium``; VL archs: ``VISION_SIZES``).
    ``head_dim``: the decoder's attention head size (one of :func:`head_dims`; None: the size's
    own): the same width in ``hidden_size // head_dim`` heads, the q/kv ratio kept where possible,
    e.g. ``head_dim=32`` for a ``tiny`` model that vLLM's CPU attention can run. Raises
    ``ValueError`` for anything else. ``head``: ``causal_lm``, or ``reward`` for a reward model (a
    text architecture's ``...ForSequenceClassification`` with one label: reward.sources'
    ``kind: model``). Deterministic in all five arguments.
    """
    spec, size_cfg = _check(arch, size)
    if head not in ("causal_lm", "reward") or (head == "reward" and spec.vision is not None):
        raise ValueError(f"head {head!r}: make_tiny_model builds causal_lm, or reward for a text architecture")
    head_dim = _split_heads(arch, size, size_cfg, head_dim)

    import torch
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vocab_target = size_cfg.pop("vocab_size")
    tokenizer = build_tokenizer(spec, vocab_target, MAX_POSITION_EMBEDDINGS, size_cfg.pop("corpus", "base"))

    eos_id = tokenizer.convert_tokens_to_ids(spec.eos)
    pad_id = tokenizer.convert_tokens_to_ids(spec.pad)
    bos_id = tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos is not None else None

    if spec.vision is not None:
        config = _vl_config(spec, size, size_cfg, tokenizer, bos_id, eos_id, pad_id)
    else:
        config = getattr(transformers, spec.config_class)(
            vocab_size=len(tokenizer),
            max_position_embeddings=MAX_POSITION_EMBEDDINGS,
            rope_parameters=dict(ROPE_PARAMETERS),
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            **size_cfg,
        )
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        if head == "reward":
            config.num_labels = 1
            model = transformers.AutoModelForSequenceClassification.from_config(config)
        else:
            model = getattr(transformers, spec.model_class)(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    pin_tokenizer_class(out, spec.tokenizer_class)
    if spec.vision is not None:
        _write_processor(out, arch)
    meta: dict[str, Any] = {"arch": arch, "size": size, "seed": seed}
    if head_dim is not None:  # only when it changes the model: the default files stay byte-identical
        meta["head_dim"] = head_dim
    if head != "causal_lm":
        meta["head"] = head
    (out / "fitrl_tiny.json").write_text(json.dumps(dict(meta, generator="fitrl.models.tiny"), indent=2) + "\n")
    return out


def describe(out_dir) -> dict[str, Any]:
    """Summarise a model directory without loading its weights (reads config + safetensors headers)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    out = Path(out_dir)
    config = AutoConfig.from_pretrained(out)
    params = 0
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                params += n
    text = config.get_text_config()  # a VL config's decoder numbers are under text_config; a text config's own
    info: dict[str, Any] = {
        "arch": config.model_type,
        "params": params,
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_layers": text.num_hidden_layers,
        "num_heads": text.num_attention_heads,
        "num_kv_heads": text.num_key_value_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "intermediate_size": text.intermediate_size,
        "max_position_embeddings": text.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "path": str(out),
    }
    if getattr(text, "num_experts", None):  # a mixture of experts: its routing, before the path
        info.update(num_experts=text.num_experts, num_experts_per_tok=text.num_experts_per_tok,
                    moe_intermediate_size=text.moe_intermediate_size)
        info["path"] = info.pop("path")
    vision = getattr(config, "vision_config", None)
    if vision is not None:  # the tower's own width: Qwen2-VL calls it embed_dim (its hidden_size is the output)
        info.update(vision_layers=vision.depth, vision_hidden_size=getattr(vision, "embed_dim", vision.hidden_size),
                    patch_size=vision.patch_size)
        info["path"] = info.pop("path")  # last, as for a text model
    meta = out / "fitrl_tiny.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        info["size"] = m.get("size")
        info["seed"] = m.get("seed")
    return info
