"""The tiny models' tokenizer: a byte-level BPE trained here on a small built-in corpus.

The corpus (arithmetic prompts in several phrasings, common English, made-up words for larger
vocabularies, chat-role words) is a fixed list of lines, so the same arguments give the same
tokenizer files. Every digit is its own token. Used by :func:`fitrl.models.tiny.make_tiny_model`.

tokenizers and transformers are imported inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["CORPORA", "build_agent_corpus", "build_corpus", "build_tokenizer", "pin_tokenizer_class"]


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
# The arithmetic lines' phrasings, taken in turn (``str.format`` fields: the operands ``a``, ``b``,
# the result ``c``, the operator's symbol ``sym`` and its word ``word``).
_PHRASINGS = (
    "What is {a} {sym} {b}?",
    "{a}{sym}{b}={c}",
    "Compute {a} {sym} {b}. Answer with a number.",
    "What is {a} {word} {b}? The answer is {c}.",
    "{a} {sym} {b} = {c}",
    "Calculate {a} {sym} {b}. Let's think step by step. #### {c}",
    "Q: {a} {sym} {b} A: {c}",
    "Solve: {a} {sym} {b}. Final answer: \\boxed{{{c}}} <answer>{c}</answer>",
)


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
        lines.append(_PHRASINGS[i % len(_PHRASINGS)].format(a=a, b=b, c=c, sym=sym, word=word))
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


def build_agent_corpus(chat_template: str) -> list[str]:
    """Tool-calling conversations rendered with ``chat_template`` (the built-in calculator and
    code interpreter, their schemas in the system turn, calls, replies and answers), for the
    tokenizer of a model meant to call tools: trained on them, its BPE merges the template's
    constant text (the schema, the call's JSON keys, the reply tags) into few tokens, so that a
    prompt with a tool is ~200 tokens instead of ~500 and a call ~30 instead of ~65
    (docs/agents.md, the example). Fixed like :func:`build_corpus`."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from fitrl.agents.tools import tool_schemas

    rng = random.Random(20261128)
    schemas = {"calculator": tool_schemas(["calculator"]), "python": tool_schemas(["python"]),
               "both": tool_schemas(["calculator", "python"])}
    lines: list[str] = []
    for i in range(240):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        tools = ("calculator", "python", "both")[i % 3]
        name, arg, code = ("python", "code", f"print({a} * {b})") if tools == "python" else (
            "calculator", "expression", f"{a} * {b}")
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {arg: code}}}]}
        conversation = [{"role": "user", "content": f"What is {a} * {b}? Use the {name}."}, call,
                        {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]
        lines.append(render_jinja_template([conversation], tools=schemas[tools], chat_template=chat_template)[0])
    return lines


# The corpora a tiny tokenizer is trained on (``SIZES``' ``corpus`` key in fitrl/models/tiny.py).
CORPORA = {"base": lambda template: build_corpus(),
           "agent": lambda template: build_corpus() + build_agent_corpus(template)}


def build_tokenizer(spec, vocab_target: int, model_max_length: int, corpus: str = "base"):
    """A ``PreTrainedTokenizerFast`` trained on ``CORPORA[corpus]`` for ``spec`` (an
    :class:`fitrl.models.tiny.ArchSpec`: its special tokens, BOS/EOS/pad, pre-tokenizer, chat
    template), about ``vocab_target`` tokens in all."""
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
    tok.train_from_iterator(CORPORA[corpus](spec.chat_template), trainer=trainer)
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
        model_max_length=model_max_length,
    )
    hf_tok.chat_template = spec.chat_template
    return hf_tok


def pin_tokenizer_class(out_dir: Path, tokenizer_class: str) -> None:
    """Record the tokenizer class ``AutoTokenizer`` will really load (keys sorted: byte-stable)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
