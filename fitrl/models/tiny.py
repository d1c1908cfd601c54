"""Tiny random-initialised causal LMs, built entirely on this machine.

``make_tiny_model(out_dir, arch="qwen2", size="tiny", seed=0)`` writes a Hugging Face model
directory (config, ``model.safetensors``, ``generation_config.json``, tokenizer files) that loads
with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. Nothing is
downloaded: the tokenizer is a byte-level BPE trained here on a small built-in corpus
(arithmetic prompts, common English, chat-role words) in which every digit is its own token.

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
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
# Corpus: deterministic, built in memory.
# ---------------------------------------------------------------------------------------------
_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see other
than then now look only come its over think also back after use two how our work first well way
even new want because any these give day most us is are was were been has had did said made went
number numbers answer answers question questions problem problems step steps think thinking result
sum total add added adding plus minus times divided equal equals subtract multiply divide value
correct wrong right left true false yes please thank thanks hello help helpful assistant user system
model reply respond response final only short explain reason reasoning check first second third
next last before after again each every many much more less few small large big little long great
old young high low early late important public same able different following end point home water
room mother area money story fact month lot study book eye job word business issue side kind head
house service friend father power hour game line member law car city community name president team
minute idea kid body information school face others level office door health person art war history
party within grow open walk win offer remember love consider appear buy wait serve die send expect
build stay fall cut reach kill remain suggest raise pass sell require report decide pull happen
apple apples orange bananas box boxes coin coins ball balls cat cats dog dogs bird birds tree trees
student students teacher class price cost pay paid buys bought sold shop store bag bags cake cookies
hours minutes days weeks dollars cents miles meters kilograms liters speed distance half twice
zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred
""".split()

_NAMES = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Tom", "Sara", "Lee"]
_ITEMS = ["apples", "coins", "books", "cookies", "marbles", "pencils", "cards", "stamps"]
_N_FAKE_WORDS = 6000


def build_corpus() -> list[str]:
    """The tokenizer training text: a fixed list of short lines (no randomness across calls)."""
    rng = random.Random(20240611)
    lines: list[str] = []

    # Arithmetic in several phrasings.
    ops = [("+", "plus", lambda a, b: a + b), ("-", "minus", lambda a, b: a - b), ("*", "times", lambda a, b: a * b)]
    pairs = [(a, b) for a in range(0, 13) for b in range(0, 13)]
    pairs += [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(300)]
    for i, (a, b) in enumerate(pairs):
        sym, word, fn = ops[i % 3]
        c = fn(a, b)
        phrasing = i % 8
        if phrasing == 0:
            lines.append(f"What is {a} {sym} {b}?")
        elif phrasing == 1:
            lines.append(f"{a}{sym}{b}={c}")
        elif phrasing == 2:
            lines.append(f"Compute {a} {sym} {b}. Answer with a number.")
        elif phrasing == 3:
            lines.append(f"What is {a} {word} {b}? The answer is {c}.")
        elif phrasing == 4:
            lines.append(f"{a} {sym} {b} = {c}")
        elif phrasing == 5:
            lines.append(f"Calculate {a} {sym} {b}. Let's think step by step. #### {c}")
        elif phrasing == 6:
            lines.append(f"Q: {a} {sym} {b} A: {c}")
        else:
            lines.append(f"Solve: {a} {sym} {b}. Final answer: \\boxed{{{c}}} <answer>{c}</answer>")
    for a in range(0, 50):
        b = rng.randint(1, 12)
        lines.append(f"Compute {a * b} / {b}. The result is {a}.")
        lines.append(f"Compute {a + b} - {b}. Answer with a number.")
    for i in range(60):
        name, item = _NAMES[i % len(_NAMES)], _ITEMS[i % len(_ITEMS)]
        a, b = rng.randint(2, 40), rng.randint(1, 20)
        lines.append(
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? "
            f"{name} has {a} + {b} = {a + b} {item}. The answer is {a + b}."
        )

    # Common English in simple sentences.
    words = list(_WORDS)
    for i in range(0, len(words), 7):
        chunk = words[i : i + 7]
        lines.append(" ".join(chunk).capitalize() + ".")
    for _ in range(400):
        k = rng.randint(4, 10)
        sent = " ".join(rng.choice(words) for _ in range(k))
        lines.append(sent.capitalize() + rng.choice([".", "?", "!", ","]))
    for w in words:
        lines.append(f"The {w} is here. {w.capitalize()}, {w}s and {w}ing.")

    # Made-up pronounceable words, each seen a few times: they only matter for the larger vocab
    # targets (a few hundred real words run out of merges near ~1.3k tokens). Rare, so the first
    # merges -- all a tiny vocab gets -- still come from the text above.
    onsets = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "ch", "sh", "th", "st", "br", "tr", "pl", "gr", "cl", "fr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "nd"]
    fake: list[str] = []
    seen: set[str] = set(words)
    while len(fake) < _N_FAKE_WORDS:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(2, 3)))
        if w not in seen:
            seen.add(w)
            fake.append(w)
    for rep in range(3):
        order = list(fake)
        rng.shuffle(order)
        for i in range(0, len(order), 8):
            chunk = order[i : i + 8]
            lines.append(" ".join(chunk).capitalize() + "." if rep else " ".join(chunk))

    # Chat-role words and instruction phrasing.
    lines += [
        "system", "user", "assistant", "System", "User", "Assistant",
        "You are a helpful assistant.",
        "You are a helpful assistant. Answer with a number.",
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "Think about the problem, then give the final answer.",
        "Sure! Here is the answer.",
        "I think the answer is",
        "Let me check the result again.",
        "Hello! How can I help you today?",
        "Thank you for the question.",
    ]
    return lines


# ---------------------------------------------------------------------------------------------
# Builders.
# ---------------------------------------------------------------------------------------------
def _check(arch: str, size: str) -> tuple[ArchSpec, dict[str, Any]]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(sorted(ARCHS))}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    return ARCHS[arch], dict(SIZES[size])


# Qwen2's pre-tokenizer split (as in ``transformers.models.qwen2.tokenization_qwen2``): ``\p{N}``
# takes one digit at a time. ``AutoTokenizer`` always loads ``Qwen2Tokenizer`` for ``model_type``
# qwen2, and that class rebuilds its normalizer/pre-tokenizer from this regex whatever
# tokenizer.json says, so the qwen2 tokenizer is trained with exactly this pipeline: tokenizer.json
# and the class AutoTokenizer returns then tokenise identically.
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_split_regex() -> str:
    try:  # follow transformers if it ever changes the regex
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        return PRETOKENIZE_REGEX
    except Exception:  # pragma: no cover - depends on the installed transformers
        return _QWEN2_SPLIT_REGEX


def _build_tokenizer(spec: ArchSpec, vocab_target: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if spec.pretokenizer == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_qwen2_split_regex()), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        # Every digit its own pre-token (so its own token), then the GPT-2 byte-level split.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_target - len(spec.special_tokens), 256),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    # Special tokens go after the learned vocabulary, as in the real models.
    tok.add_special_tokens(list(spec.special_tokens))

    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec.add_bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{spec.bos}:0 $A:0",
                    pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
                    special_tokens=[(spec.bos, bos_id)],
                ),
            ]
        )
    else:
        tok.post_processor = byte_level

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        unk_token=None,
        extra_special_tokens=[t for t in spec.special_tokens if t not in (spec.bos, spec.eos, spec.pad)],
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    hf_tok.chat_template = spec.chat_template
    return hf_tok


def _pin_tokenizer_class(out_dir: Path, tokenizer_class: str) -> None:
    """Record the tokenizer class ``AutoTokenizer`` will really load (keys sorted: byte-stable)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


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
    tokenizer = _build_tokenizer(spec, vocab_target)

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
    _pin_tokenizer_class(out, spec.tokenizer_class)
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
