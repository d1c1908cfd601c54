"""``fitrl export CHECKPOINT OUT_DIR [--dtype bf16] [--lora merged|adapter] [--base DIR]``: a
checkpoint's policy as a Hugging Face model directory (safetensors weights, config.json,
generation_config.json, tokenizer files), loadable with ``AutoModelForCausalLM.from_pretrained``
and by inference engines (vLLM reads the same layout). A vision-language policy (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL: :mod:`fitrl.models.vl_types`) loads with ``AutoModelForImageTextToText``
instead, and its processor files (``preprocessor_config.json``, the video processor's, the chat
template) go with it: the checkpoint's ``hf/`` holds them like the tokenizer's.

A LoRA checkpoint holds the adapters only; by default (``--lora merged``) they are merged into
the base weights read from the base's directory (recorded at save time, or ``--base``), so the
export is a plain model as above. ``--lora adapter`` writes PEFT's adapter directory instead
(fitrl/checkpoint/lora.py), for ``PeftModel.from_pretrained`` or an engine that serves adapters.

The weights are read from the sharded checkpoint in one process, without a process group,
one output file at a time: each ``model-0000i-of-0000n.safetensors`` (at most
``max_shard_bytes``, 5 GiB by default as in ``save_pretrained``) is loaded, converted and
written before the next is read, so host memory stays about one output file, not the model.
The result is written under a temporary name and renamed when whole.

Import-light (the CLI builds its parser from here): torch loads only when an export runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Optional

from fitrl.checkpoint import layout
from fitrl.checkpoint.layout import CheckpointError
from fitrl.core.errors import CheckpointUsageError, UserError
from fitrl.models.check import check_weights, read_model_config
from fitrl.models.hub import resolve_base
from fitrl.models.vl_types import IMAGE_PROCESSOR_FILE, auto_class_name, is_vision_language

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LORA_MODES = ("merged", "adapter")


def export_checkpoint(checkpoint: str, out_dir: str, dtype: Optional[str] = None,
                      max_shard_bytes: int = 5 * 2**30, lora: Optional[str] = None,
                      base: Optional[str] = None) -> dict:
    """Write the actor of ``checkpoint`` (a ``step_N`` dir, or a run dir: its newest) to ``out_dir``.
    ``dtype``: ``fp32``/``bf16``/``fp16`` (default: as saved). ``lora`` (LoRA checkpoints):
    ``merged`` (default) or ``adapter``; ``base``: the base model's directory when it moved
    since the save. Returns a summary."""
    # torch, the DCP reader and the LoRA exporter load here, not when the CLI builds its parser
    import torch

    from fitrl.checkpoint import lora as lora_export
    from fitrl.checkpoint import sharded

    point = layout.find(checkpoint)
    if lora is not None and lora not in LORA_MODES:
        raise CheckpointUsageError(f"--lora {lora}: choose one of {', '.join(LORA_MODES)}")
    if not point.adapter_only and lora == "adapter":
        raise CheckpointUsageError(f"checkpoint {point.path} holds the full policy (saved with actor.lora.rank=0), not "
                              "LoRA adapters: --lora adapter needs a checkpoint of a LoRA run")
    mode = (lora or "merged") if point.adapter_only else "full"
    base = resolve_base(base, weights=mode == "merged")  # a Hub id: its snapshot in the HF cache (fitrl/models/hub.py)
    actor, hf = point.path / "actor", point.path / "hf"
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"checkpoint {point.path} has no hf/config.json (the model's config is saved with each "
                              "checkpoint; this one is incomplete or was not written by fitrl)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointUsageError(f"{out} already exists and is not empty: choose a new output directory")
    # the model's config as saved (parses, has its shape), and a merge's base weights, before any write
    config = read_model_config(str(hf), f"the model config of checkpoint {point.path}")
    if is_vision_language(config["model_type"]) and not (hf / IMAGE_PROCESSOR_FILE).is_file():
        raise CheckpointError(f"checkpoint {point.path} has no hf/{IMAGE_PROCESSOR_FILE}: {config['model_type']} is a "
                              "vision-language model and its export needs the image processor config; copy it "
                              "into hf/ from the model directory the run read (actor.model.path)")
    if mode == "merged":
        base_root = lora_export.base_dir(point, base)
        check_weights(str(base_root), read_model_config(str(base_root), "--base"), "--base")
    target = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    tmp = out.parent / f"{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        if mode == "adapter":
            summary = lora_export.write_adapter(point, tmp, target, base)
        else:
            if mode == "merged":
                shapes, read = lora_export.merged_weights(point, base, config)
            else:
                saved = sharded.model_keys(actor)
                if config.get("tie_word_embeddings") and "lm_head.weight" in saved:
                    del saved["lm_head.weight"]  # the same tensor as the input embeddings; from_pretrained re-ties it
                shapes = {k: (tuple(m.size), m.properties.dtype) for k, m in saved.items()}

                def read(keys):
                    return sharded.load_tensors(actor, {k: saved[k] for k in keys})
            summary = _write_weights(tmp, shapes, read, target, max_shard_bytes)
            summary["dtype"] = DTYPE_NAMES[dtype] if dtype else summary["dtype"]
            config["dtype"] = summary["dtype"]
            if "torch_dtype" in config:  # older transformers versions read this key
                config["torch_dtype"] = config["dtype"]
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in hf.iterdir():  # tokenizer files, chat template, generation config, VL processor files, ...
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        if mode != "adapter" and not (tmp / "generation_config.json").is_file():
            gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": str(out), "step": point.step, "checkpoint": str(point.path), "kind": mode,
            "auto_class": auto_class_name(config["model_type"]), **summary}


def _write_weights(tmp: Path, shapes: dict, read, target, max_shard_bytes: int) -> dict:
    """``model.safetensors`` (or numbered files and their index) in ``tmp``, one file's tensors
    in memory at a time: ``shapes`` maps each weight to (shape, dtype), ``read(keys)`` loads some."""
    from safetensors.torch import save_file  # with torch, at export time only

    groups = _groups(shapes, target, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for name, keys in zip(names, groups):
        tensors = read(keys)
        if target is not None:
            tensors = {k: v.to(target) for k, v in tensors.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    if len(names) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    saved_dtype = str(next(iter(shapes.values()))[1]).removeprefix("torch.")
    return {"files": len(names), "params": sum(_numel(shape) for shape, _ in shapes.values()), "bytes": total,
            "dtype": saved_dtype}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _groups(shapes: dict, target, max_bytes: int) -> list[list[str]]:
    """Consecutive runs of weights of at most ``max_bytes`` each (one tensor may exceed it alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, (shape, dt) in shapes.items():
        nbytes = _numel(shape) * (target or dt).itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def cmd_export(args: argparse.Namespace) -> int:
    try:
        s = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype, lora=args.lora, base=args.base)
    except CheckpointError as e:
        if isinstance(e, UserError):  # a mistake in the command (exit 2): the CLI prints it
            raise
        print(f"fitrl: export failed: {e}", file=sys.stderr)
        return 1
    what = {"full": "", "merged": "LoRA merged into the base, ", "adapter": "LoRA adapter (PEFT), "}[s["kind"]]
    print(f"wrote {s['out_dir']}: step {s['step']} of {s['checkpoint']}, {what}{s['params'] / 1e6:.2f}M params, "
          f"{s['dtype']}, {s['bytes'] / 2**20:.1f} MiB in {s['files']} safetensors file(s)")
    return 0


def add_export_command(subparsers) -> None:
    """Register ``fitrl export`` on the CLI's subparsers (exit 0 on success; 2 with a one-line
    message when the checkpoint does not exist or OUT_DIR is not empty, a mistake in the command;
    1 when the checkpoint is incomplete or corrupt)."""
    p = subparsers.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (its newest)")
    p.add_argument("out_dir", help="a new directory for the model (safetensors, config, tokenizer, generation config)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="weight dtype of the export (default: as saved, i.e. the fp32 master weights)")
    p.add_argument("--lora", choices=LORA_MODES, default=None,
                   help="a LoRA checkpoint (adapters only) as: merged (default), the full model with the adapters "
                        "merged into the base weights; adapter, PEFT's adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) for PeftModel.from_pretrained")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="LoRA checkpoints: the base model's directory, when it is no longer where the run read it "
                        "(actor.model.path, recorded in the checkpoint)")
    p.set_defaults(fn=cmd_export)
