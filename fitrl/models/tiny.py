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

Same arguments give byte-identical weights and tokenizer files. The tokenizer does not depend on
``seed``, so models built with different seeds share one vocabulary.

Heavy imports (torch, transformers, tokenizers) happen inside the functions: importing this module
is cheap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitrl.models.tiny_tokenizer import build_corpus, build_tokenizer, pin_tokenizer_class

__all__ = ["ARCHS", "SIZES", "make_tiny_model", "describe", "build_corpus"]

# ---------------------------------------------------------------------------------------------
# Size table. Add a row to add a size; every key is passed to the HF config except ``vocab_size``,
# which is the BPE target (the model's vocab is ``len(tokenizer)``, whatever BPE reaches).
# ---------------------------------------------------------------------------------------------
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=8192,
        tie_word_embeddings=False,
    ),
    # ~0.2B parameters (0.8 GiB in fp32): big enough that loading, not process overhead,
    # dominates host memory in the rank-0 initialisation benchmark
    "medium": dict(
        hidden_size=1024,
        num_hidden_layers=14,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=8192,
        tie_word_embeddings=False,
    ),
}

MAX_POSITION_EMBEDDINGS = 2048
ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0}

# Renders a message's content: a string, or a list of {"type": "text", "text": ...} parts.
_CONTENT = (
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
)

_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}" + _CONTENT + "{{- '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ArchSpec:
    config_class: str  # name in ``transformers``
    model_class: str
    special_tokens: tuple[str, ...]  # appended after the BPE vocabulary, in this order
    bos: str | None  # None: the model has no BOS
    eos: str  # end of an assistant turn; generation stops here
    pad: str
    chat_template: str
    add_bos: bool  # whether plain ``tokenizer(text)`` prepends the BOS
    pretokenizer: str  # "qwen2": Qwen2's own split regex; "digits": Digits(individual) + ByteLevel regex
    tokenizer_class: str  # written to tokenizer_config.json: the class AutoTokenizer really loads


ARCHS: dict[str, ArchSpec] = {
    "qwen2": ArchSpec(
        config_class="Qwen2Config",
        model_class="Qwen2ForCausalLM",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        add_bos=False,
        pretokenizer="qwen2",
        tokenizer_class="Qwen2Tokenizer",
    ),
    "llama": ArchSpec(
        config_class="LlamaConfig",
        model_class="LlamaForCausalLM",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        chat_template=_LLAMA3_TEMPLATE,
        add_bos=True,
        pretokenizer="digits",
        tokenizer_class="PreTrainedTokenizerFast",
    ),
}


# ---------------------------------------------------------------------------------------------
# Builders.
# ---------------------------------------------------------------------------------------------
def _check(arch: str, size: str) -> tuple[ArchSpec, dict[str, Any]]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(sorted(ARCHS))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    return ARCHS[arch], dict(SIZES[size])


def make_tiny_model(out_dir, arch: str = "qwen2", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-initialised HF causal LM + tokenizer to ``out_dir`` and return its path.

    ``arch``: one of ``ARCHS`` (``qwen2``, ``llama``); ``size``: one of ``SIZES`` (``tiny``,
    ``small``). Raises ``ValueError`` for anything else. Deterministic in all three arguments.
    """
    spec, size_cfg = _check(arch, size)

    import torch
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vocab_target = size_cfg.pop("vocab_size")
    tokenizer = build_tokenizer(spec, vocab_target, MAX_POSITION_EMBEDDINGS)

    eos_id = tokenizer.convert_tokens_to_ids(spec.eos)
    pad_id = tokenizer.convert_tokens_to_ids(spec.pad)
    bos_id = tokenizer.convert_tokens_to_ids(spec.bos) if spec.bos is not None else None

    config = getattr(transformers, spec.config_class)(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_parameters=dict(ROPE_PARAMETERS),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **size_cfg,
    )
    model_cls = getattr(transformers, spec.model_class)
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = model_cls(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    pin_tokenizer_class(out, spec.tokenizer_class)
    (out / "fitrl_tiny.json").write_text(
        json.dumps({"arch": arch, "size": size, "seed": seed, "generator": "fitrl.models.tiny"}, indent=2) + "\n"
    )
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
    info: dict[str, Any] = {
        "arch": config.model_type,
        "params": params,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "path": str(out),
    }
    meta = out / "fitrl_tiny.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        info["size"] = m.get("size")
        info["seed"] = m.get("seed")
    return info
