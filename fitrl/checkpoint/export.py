"""``fitrl export CHECKPOINT OUT_DIR [--dtype bf16]``: a checkpoint's policy as a Hugging Face
model directory (safetensors weights, config.json, generation_config.json, tokenizer files),
loadable with ``AutoModelForCausalLM.from_pretrained`` and by inference engines (vLLM reads the
same layout).

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

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_checkpoint(checkpoint: str, out_dir: str, dtype: Optional[str] = None,
                      max_shard_bytes: int = 5 * 2**30) -> dict:
    """Write the actor of ``checkpoint`` (a ``step_N`` dir, or a run dir: its newest) to ``out_dir``.
    ``dtype``: ``fp32``/``bf16``/``fp16`` (default: as saved). Returns a summary."""
    # torch and the DCP reader load here, not when the CLI builds its parser
    import torch
    from safetensors.torch import save_file

    from fitrl.checkpoint import sharded

    point = layout.find(checkpoint)
    actor, hf = point.path / "actor", point.path / "hf"
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"checkpoint {point.path} has no hf/config.json (the model's config is saved with each "
                              "checkpoint; this one is incomplete or was not written by fitrl)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty: choose a new output directory")
    shapes = sharded.model_keys(actor)
    config = json.loads((hf / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" in shapes:
        del shapes["lm_head.weight"]  # the same tensor as the input embeddings; from_pretrained re-ties it
    target = getattr(torch, DTYPE_NAMES[dtype]) if dtype else None
    groups = _groups(shapes, target, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    tmp = out.parent / f"{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for name, keys in zip(names, groups):
            tensors = sharded.load_tensors(actor, {k: shapes[k] for k in keys})
            if target is not None:
                tensors = {k: v.to(target) for k, v in tensors.items()}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
            del tensors
        if len(names) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        for f in hf.iterdir():  # tokenizer files, chat template, generation config, ...
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        saved_dtype = str(next(iter(shapes.values())).properties.dtype).removeprefix("torch.")
        config["dtype"] = DTYPE_NAMES[dtype] if dtype else saved_dtype
        if "torch_dtype" in config:  # older transformers versions read this key
            config["torch_dtype"] = config["dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if not (tmp / "generation_config.json").is_file():
            gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    params = sum(_numel(m) for m in shapes.values())
    return {"out_dir": str(out), "step": point.step, "checkpoint": str(point.path), "files": len(names),
            "params": params, "bytes": total, "dtype": config["dtype"]}


def _numel(meta) -> int:
    n = 1
    for d in meta.size:
        n *= d
    return n


def _groups(shapes: dict, target, max_bytes: int) -> list[list[str]]:
    """Consecutive runs of weights of at most ``max_bytes`` each (one tensor may exceed it alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k, m in shapes.items():
        nbytes = _numel(m) * (target or m.properties.dtype).itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def cmd_export(args: argparse.Namespace) -> int:
    try:
        s = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype)
    except CheckpointError as e:
        print(f"fitrl: export failed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {s['out_dir']}: step {s['step']} of {s['checkpoint']}, {s['params'] / 1e6:.2f}M params, "
          f"{s['dtype']}, {s['bytes'] / 2**20:.1f} MiB in {s['files']} safetensors file(s)")
    return 0


def add_export_command(subparsers) -> None:
    """Register ``fitrl export`` on the CLI's subparsers (exit 0 on success, 1 with a one-line
    message when the checkpoint is missing, incomplete or corrupt, or OUT_DIR is not empty)."""
    p = subparsers.add_parser("export", help="write a checkpoint's policy as a Hugging Face model directory")
    p.add_argument("checkpoint", help="a checkpoint (RUN_DIR/checkpoints/step_N) or a run directory (its newest)")
    p.add_argument("out_dir", help="a new directory for the model (safetensors, config, tokenizer, generation config)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="weight dtype of the export (default: as saved, i.e. the fp32 master weights)")
    p.set_defaults(fn=cmd_export)
