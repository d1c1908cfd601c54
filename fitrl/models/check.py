"""Checking a model directory before anything heavy loads (``fitrl train``, ``plan``, ``export``).

A model directory that cannot serve a run should fail in the first seconds, in one line that
names the file (or config key) and the fix, not minutes later inside transformers or generate
with a library's message (or, worse, train on: transformers builds an *empty* tokenizer
without a word when the vocabulary file is missing). What is checked, cheapest first:

- ``config.json``: it exists, parses (a bad line is named), and holds the shape keys the
  model families and the memory planner read (:data:`SHAPE_KEYS`) as positive integers
  (:func:`read_model_config`; standard library only: ``fitrl plan`` needs nothing more);
- its ``model_type`` is one a family claims or transformers builds for the head the role
  needs (causal LM, or token classification for a critic); a vision-language type
  (:mod:`fitrl.models.vl_types`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) serves as a policy too;
- the weights: present (``model.safetensors``, shards with their index, or
  ``pytorch_model*.bin``), every file the index names exists, and every safetensors header
  parses and covers the file (only the header is read: a truncated or garbage file is named
  without reading its tensors), the embedding's shape agrees with ``config.json``;
- the tokenizer (``tokenizer_path`` or the model's directory): it is a local directory (never a
  message about a hub), it loads, it is not empty, it has an end-of-sequence token, a chat
  template when ``data.apply_chat_template`` is on, and its ids fit the model's embedding;
- a vision-language actor's image processor config (``preprocessor_config.json``) is there.

Every failure is a :class:`~fitrl.core.errors.ModelDirError` (a ``ConfigError``: exit 2).
"""

from __future__ import annotations

import difflib
import json
import struct
import zipfile
from pathlib import Path
from typing import Any, Optional

from fitrl.config.schema import adjusted
from fitrl.core.errors import ModelDirError
from fitrl.distributed.heads import INNER as ULYSSES_INNER, check_heads
from fitrl.ops.sharing import full_attention
from fitrl.models.config_json import check_path, read_config_json
from fitrl.models.teacher_check import check_same_tokenizer, check_topk_fits
from fitrl.models.vl_types import IMAGE_PROCESSOR_FILE, is_vision_language

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
"""``config.json`` keys every text model has and fitrl reads (the planner's tensor shapes, the
families' builders, the tokenizer-fits-embedding check); a vision-language config may hold
them in its ``text_config``."""

VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "vocab.txt",
               "sentencepiece.bpe.model", "tokenizer.tiktoken")
"""Files that hold a tokenizer's vocabulary (named in messages when a tokenizer comes out empty)."""

MIN_REGULAR_TOKENS = 16
"""Fewer non-special tokens than this is an empty tokenizer (a byte-level one has 256 at least)."""

MAX_HEADER_BYTES = 100 * 2**20
"""safetensors caps its JSON header at 100 MB; a larger length field means garbage, not a header."""

# transformers' own loaders for each head a role builds (model families may claim more types)
_HEAD_MAPPINGS = {"causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                  "value": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                  "reward": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"}


# ----------------------------------------------------------------------------- config.json
# (read by fitrl/models/config_json.py, which the shape and the families import without these checks)

def read_model_config(path: str, what: str = "actor.model.path") -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory ``path``, with its shape keys checked."""
    root = check_path(path, what)  # (a file given here is a mistake: the directory is asked for)
    config = read_config_json(root, what)
    file = root / "config.json"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    missing = [k for k in SHAPE_KEYS if k not in config and k not in text]
    if missing:
        raise ModelDirError(f"{file} has no {', '.join(missing)}: not a (complete) Hugging Face model config; "
                            "fitrl and its memory planner read the model's shape from these keys: restore the "
                            "config.json that came with the weights")
    for key in SHAPE_KEYS:
        value = config[key] if key in config else text[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelDirError(f"{file}: {key}={value!r} must be a positive integer")
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ModelDirError(f"{file} has no model_type: transformers cannot tell which architecture it is "
                            "(e.g. \"model_type\": \"qwen2\")")
    return config


def shape_value(config: dict[str, Any], key: str) -> Any:
    """A shape key from the top level or, for vision-language configs, ``text_config``."""
    return config[key] if key in config else (config.get("text_config") or {}).get(key)


def check_model_type(config: dict[str, Any], path: str, head: str = "causal_lm") -> None:
    """``model_type`` is claimed by a model family or built by transformers for ``head``."""
    from fitrl.models.families import MODEL_FAMILIES  # torch: only once the cheap checks passed

    kind = config["model_type"]
    if any(kind in MODEL_FAMILIES.get(name).model_types for name in MODEL_FAMILIES):
        return
    if head == "causal_lm" and is_vision_language(kind):  # transformers builds it as image-text-to-text
        return
    import transformers.models.auto.modeling_auto as auto

    known = getattr(auto, _HEAD_MAPPINGS[head])
    if kind in known:
        return
    near = difflib.get_close_matches(kind, list(known), n=1)
    role = "a causal language model" if head == "causal_lm" else "a token-classification (value) model"
    raise ModelDirError(f"{Path(path) / 'config.json'}: model_type {kind!r} is not a model type transformers "
                        f"{transformers_version()} builds as {role}"
                        + (f"; did you mean {near[0]!r}?" if near else "")
                        + " (a newer transformers may know it; fitrl runs text decoders such as qwen2, llama, mistral)")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


# ----------------------------------------------------------------------------- weights

def check_weights(path: str, config: dict[str, Any], what: str = "actor.model.path") -> list[Path]:
    """The weight files transformers will load from ``path``, each checked cheaply; returns them."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    bin_index = root / "pytorch_model.bin.index.json"
    if index.is_file():
        files = _files_of_index(index, root)
    elif single.is_file():
        files = [single]
    elif bin_index.is_file():
        files = _files_of_index(bin_index, root)
    elif (root / "pytorch_model.bin").is_file():
        files = [root / "pytorch_model.bin"]
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if shards:
            raise ModelDirError(f"{what}={path!r} has {', '.join(shards[:3])}{' ...' if len(shards) > 3 else ''} but "
                                "no model.safetensors.index.json saying which weight is in which file: copy the "
                                "index that came with them")
        raise ModelDirError(f"{what}={path!r} has no weights (model.safetensors, sharded model-*.safetensors with "
                            "model.safetensors.index.json, or pytorch_model.bin); a directory with config.json "
                            "alone serves `fitrl plan`, not a run")
    shapes: dict[str, list[int]] = {}
    for f in files:
        if f.suffix == ".safetensors":
            shapes.update(read_safetensors_header(f))
        else:
            _check_torch_file(f)
    _check_embedding(shapes, config, root)
    return files


def _files_of_index(index: Path, root: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{index}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
    except (KeyError, TypeError, AttributeError, OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{index} is not a weight index (no weight_map of weight -> file: {e})") from None
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ModelDirError(f"{index} names {len(missing)} file(s) that are not in {root}: {', '.join(missing[:3])}"
                            f"{' ...' if len(missing) > 3 else ''}; the download or copy is incomplete")
    return [root / n for n in names]


def read_safetensors_header(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's header, after checking that the header
    parses and that the file holds every byte it describes (only the header is read).

    The format: 8 bytes little-endian header length ``N``, ``N`` bytes of JSON
    (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``), the data."""
    size = file.stat().st_size
    hint = "re-copy or re-download it"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelDirError(f"{file} is {size} bytes: truncated or empty, not a safetensors file; {hint}")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ModelDirError(f"{file} is not a readable safetensors file (its header length field says {n:,} "
                                f"bytes, the file has {size:,}): garbage or truncated; {hint}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        ends = [int(v["data_offsets"][1]) for v in tensors.values()]
        shapes = {k: [int(d) for d in v["shape"]] for k, v in tensors.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ModelDirError(f"{file} is not a readable safetensors file (its header does not parse: "
                            f"{type(e).__name__}); garbage or overwritten; {hint}") from None
    needed = 8 + n + max(ends, default=0)
    if size < needed:
        raise ModelDirError(f"{file} is truncated: {size:,} bytes, its header describes {needed:,}; {hint}")
    return shapes


def _check_torch_file(file: Path) -> None:
    """A ``pytorch_model*.bin`` is a zip archive (torch.save) or an old-style pickle (protocol 2+
    starts with 0x80): anything else is garbage. Its tensors are not read here."""
    with open(file, "rb") as f:
        first = f.read(1)
    if not first or (first != b"\x80" and not zipfile.is_zipfile(file)):
        raise ModelDirError(f"{file} is not a torch checkpoint (empty, truncated or garbage); re-copy or "
                            "re-download it")


def _check_embedding(shapes: dict[str, list[int]], config: dict[str, Any], root: Path) -> None:
    """The input embedding's rows and width agree with ``config.json`` (a config from another model)."""
    embed = next((k for k in shapes if k.endswith("embed_tokens.weight")), None)
    if embed is None or len(shapes[embed]) != 2:
        return
    rows, width = shapes[embed]
    vocab, hidden = shape_value(config, "vocab_size"), shape_value(config, "hidden_size")
    if (rows, width) != (vocab, hidden):
        raise ModelDirError(f"{root / 'config.json'} does not belong to the weights beside it: it says vocab_size="
                            f"{vocab}, hidden_size={hidden} but {embed} has shape ({rows}, {width}); restore the "
                            "config.json that came with the weights")


# ----------------------------------------------------------------------------- tokenizer

def load_local_tokenizer(path: str):
    """The tokenizer of a local directory, left-padded (every prompt's last token in the same
    column for batched generate). Nothing is fetched (``local_files_only``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    return tok


def check_tokenizer(model_path: str, tokenizer_path: Optional[str], config: dict[str, Any], *,
                    prefix: str = "actor.model", chat_template: bool = False):
    """Load and check the tokenizer a role reads; returns it (so the run need not load it again)."""
    if tokenizer_path:
        where, key = str(check_path(tokenizer_path, f"{prefix}.tokenizer_path")), f"{prefix}.tokenizer_path"
    else:
        where, key = model_path, f"{prefix}.path"
    try:
        tok = load_local_tokenizer(where)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a broken directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelDirError(f"cannot load the tokenizer in {where} ({key}): {type(e).__name__}: {first[:300]}"
                            f"{_files_note(where)}") from None
    specials = set(tok.all_special_tokens)
    regular = [t for t in tok.get_vocab() if t not in specials]
    if len(regular) < MIN_REGULAR_TOKENS:
        raise ModelDirError(f"the tokenizer in {where} ({key}) is empty: {len(tok)} token(s), {len(regular)} of them "
                            f"not special{_files_note(where)}; copy the model's tokenizer files there, or set "
                            f"{prefix}.tokenizer_path to the directory that has them")
    vocab_size = shape_value(config, "vocab_size")
    ids = len(tok), max(tok.get_vocab().values(), default=-1) + 1
    if max(ids) > vocab_size:
        raise ModelDirError(f"the tokenizer in {where} ({key}) has {max(ids)} token ids but the model's embedding has "
                            f"vocab_size={vocab_size} rows ({Path(model_path) / 'config.json'}): ids past it would "
                            "index outside the embedding; use the model's own tokenizer")
    eos = _eos_ids(tok, model_path, config)
    if not eos:
        raise ModelDirError(f"no end-of-sequence token: neither the tokenizer in {where} (eos_token in "
                            "tokenizer_config.json) nor the model's generation_config.json or config.json "
                            "(eos_token_id) names one, so generation could never stop; set eos_token in "
                            f"{Path(where) / 'tokenizer_config.json'}")
    for name, token_ids in (("eos", eos), ("pad", [tok.pad_token_id] if tok.pad_token_id is not None else [])):
        outside = [i for i in token_ids if not 0 <= i < vocab_size]
        if outside:
            raise ModelDirError(f"the {name} token id {outside[0]} of {where} is outside the model's vocabulary "
                                f"(vocab_size={vocab_size}): the tokenizer does not belong to this model")
    if chat_template and not tok.chat_template:
        raise ModelDirError(f"the tokenizer in {where} ({key}) has no chat template (no chat_template.jinja, no "
                            "chat_template in tokenizer_config.json) and data.apply_chat_template=true: set "
                            "data.apply_chat_template=false (prompts as plain text, shaped by data.prompt_template) "
                            "or use a tokenizer that has one")
    return tok


def check_image_processor(model_path: str, tokenizer_path: Optional[str], config: dict[str, Any], *,
                          prefix: str = "actor.model") -> Optional[Path]:
    """A vision-language model's image processor config (:data:`IMAGE_PROCESSOR_FILE`) is in its
    directory (or in ``tokenizer_path``, where the tokenizer came from); returns its path, None
    for a text model. Only the file's presence and JSON are checked: the image pipeline reads it."""
    if not is_vision_language(str(config.get("model_type", ""))):
        return None
    places = [Path(p) for p in (tokenizer_path, model_path) if p]
    found = next((d / IMAGE_PROCESSOR_FILE for d in places if (d / IMAGE_PROCESSOR_FILE).is_file()), None)
    if found is None:
        raise ModelDirError(f"{Path(model_path) / IMAGE_PROCESSOR_FILE} is missing ({prefix}.path): "
                            f"{config['model_type']} is a vision-language model and its image processor config "
                            "(patch and merge size, mean/std, pixel budget) is read from that file; copy it from "
                            "the checkpoint the weights came with")
    try:
        json.loads(found.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{found}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); restore the "
                            f"{IMAGE_PROCESSOR_FILE} that came with the model") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"cannot read {found}: {e}") from None
    return found


def _eos_ids(tok, model_path: str, config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids as generation will see them: the tokenizer's, generation_config.json's
    and config.json's (the rollout engine stops at any of them)."""
    found: list[Any] = [tok.eos_token_id, config.get("eos_token_id")]
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        try:
            found.append(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, OSError, AttributeError) as e:
            raise ModelDirError(f"cannot read {gen}: {e}") from None
    ids: list[int] = []
    for value in found:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids


def _files_note(where: str) -> str:
    present = sorted(p.name for p in Path(where).iterdir() if p.is_file()) if Path(where).is_dir() else []
    vocab = [f for f in present if f in VOCAB_FILES]
    if vocab:
        return f" (vocabulary files there: {', '.join(vocab)})"
    return (f" (no vocabulary file there: none of {', '.join(VOCAB_FILES[:5])}; found "
            f"{', '.join(present[:8]) or 'no files'}{' ...' if len(present) > 8 else ''})")


# ----------------------------------------------------------------------------- a whole run

def run_models(cfg) -> list[tuple[Any, str, str]]:
    """``(ModelConfig, key prefix, head)`` of every model directory the run will load: the
    actor's, the reference's and critic's when they are set and the algorithm builds them, and
    the teacher's when distillation is on."""
    from fitrl.config.choices import algorithm_needs

    models = [(cfg.actor.model, "actor.model", "causal_lm")]
    needs = algorithm_needs(cfg)
    if needs.reference and not cfg.actor.lora.enabled and cfg.ref.model is not None:
        models.append((cfg.ref.model, "ref.model", "causal_lm"))
    if needs.critic and cfg.critic.model is not None:
        models.append((cfg.critic.model, "critic.model", "value"))
    if cfg.algorithm.distill.enabled and cfg.teacher.model is not None:
        models.append((cfg.teacher.model, "teacher.model", "causal_lm"))
    return models


def check_model_configs(cfg, configs: Optional[dict[str, dict[str, Any]]] = None) -> None:
    """Every ``config.json`` the run reads, and its model type: what the memory plan needs, so
    this runs before it (a directory holding only ``config.json`` can still be planned).
    ``configs``: each config section's parsed ``config.json`` when already read
    (fitrl/models/description.py, ``RunModels.configs``); otherwise each is read here."""
    vocab = {}
    for model, prefix, head in run_models(cfg):
        config = _config_of(configs, model, prefix)
        check_model_type(config, model.path, head)
        vocab[prefix] = shape_value(config, "vocab_size")
        if head == "causal_lm" and cfg.actor.ulysses_size > 1 and prefix != "teacher.model":  # (no SP: its own pass)
            check_sequence_parallel(config, model, prefix, cfg.actor.ulysses_size)
        if prefix == "actor.model" and cfg.actor.packing and is_vision_language(config.get("model_type", "")):
            adjusted(cfg, "actor.packing does not apply to a vision-language model (its images ride with the prompt "
                          "and its rope has three position axes): its forwards stay padded")
    for name, src in cfg.reward.sources.items():  # reward models and judges: their own vocabularies
        if src.kind != "function":
            config = _config_of(configs, src.model, f"reward.sources.{name}.model")
            check_model_type(config, src.model.path, "reward" if src.kind == "model" else "causal_lm")
    if "teacher.model" in vocab:
        check_topk_fits(cfg, min(vocab["teacher.model"], vocab["actor.model"]))


def _config_of(configs: Optional[dict[str, dict[str, Any]]], model, prefix: str) -> dict[str, Any]:
    """The parsed ``config.json`` of section ``prefix`` from ``configs``, or read now."""
    if configs is not None and prefix in configs:
        return configs[prefix]
    return read_model_config(model.path, f"{prefix}.path")


def check_sequence_parallel(config: dict[str, Any], model, prefix: str, size: int) -> None:
    """Can ``size``-way Ulysses split this model's sequences (fitrl/distributed/ulysses.py)?"""
    why = ulysses_refusal(config, model.attn_implementation, size, f"{prefix}.attn_implementation")
    if why:
        raise ModelDirError(f"actor.ulysses_size={size} cannot split {prefix}.path={model.path!r}: {why}")


def ulysses_refusal(config: dict[str, Any], attn: str, size: int, attn_key: str = "attn_implementation") -> Optional[str]:
    """Why ``size``-way Ulysses cannot split a model with this ``config.json`` and attention
    implementation (None: it can); the start-up check and the recommender both ask here."""
    if is_vision_language(config.get("model_type", "")):
        return "a vision-language model's images and multimodal rope are not split over ranks yet"
    if attn not in ULYSSES_INNER:
        return f"{attn_key}={attn!r}: use sdpa or eager"
    if not full_attention(config):
        return "its sliding-window attention layers are not supported"
    return check_heads(config.get("num_attention_heads"), config.get("num_key_value_heads"), size)


def check_run_models(cfg, configs: Optional[dict[str, dict[str, Any]]] = None) -> Any:
    """The weights of every model directory the run loads and the actor's tokenizer, before the
    reward, the data or any model loads (after :func:`check_model_configs`; ``configs`` as
    there). Returns the actor's tokenizer, so the run does not load it twice."""
    tokenizer = None
    for model, prefix, head in run_models(cfg):
        config = _config_of(configs, model, prefix)
        check_weights(model.path, config, f"{prefix}.path")
        if tokenizer is None:  # the actor: its tokenizer is the run's
            tokenizer = check_tokenizer(model.path, model.tokenizer_path, config, prefix=prefix,
                                        chat_template=cfg.data.apply_chat_template)
            check_image_processor(model.path, model.tokenizer_path, config, prefix=prefix)
        elif shape_value(config, "vocab_size") < len(tokenizer):  # the actor's ids index this embedding too
            raise ModelDirError(f"{prefix}.path={model.path!r} has vocab_size={shape_value(config, 'vocab_size')} but "
                                f"the actor's tokenizer has {len(tokenizer)} tokens: the {prefix.split('.')[0]} "
                                "model must share the actor's vocabulary")
        if prefix == "teacher.model":  # it scores the actor's token ids: the same tokenizer
            check_same_tokenizer(cfg, tokenizer, check_tokenizer(model.path, model.tokenizer_path, config,
                                                                 prefix=prefix))
    return tokenizer
