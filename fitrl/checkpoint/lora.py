"""``fitrl export`` of a LoRA checkpoint (``actor.lora.rank > 0``: the actor's weights in it are the
adapters only, see fitrl/checkpoint/manager.py), in one process, without a model:

- ``adapter``: PEFT's adapter directory, as ``PeftModel.save_pretrained`` writes it:
  ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight`` /
  ``lora_B.weight``, no adapter name) and ``adapter_config.json`` (``base_model_name_or_path``:
  the base's directory). Loads with ``PeftModel.from_pretrained(base_model, adapter_dir)``.
- ``merged``: the full weights of the policy, ``W + (alpha / rank) * B @ A`` in each adapted
  linear layer (under its own name: no ``base_layer``), read from the base's safetensors files
  one output file at a time (:func:`merged_weights` feeds fitrl/checkpoint/export.py's writer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fitrl.checkpoint import sharded
from fitrl.checkpoint.layout import Checkpoint, CheckpointError
from fitrl.core.errors import CheckpointUsageError
from fitrl.models.params import ADAPTER

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_ADAPTER_KEY = re.compile(rf"^(.+)\.lora_([AB])\.{re.escape(ADAPTER)}\.weight$")

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
Reader = Callable[[list[str]], dict[str, torch.Tensor]]


def adapter_modules(point: Checkpoint) -> tuple[dict, dict[str, tuple[str, str]]]:
    """The checkpoint's adapter weights (DCP metadata by name) and, per adapted module, the
    names of its ``lora_A`` and ``lora_B`` weights."""
    shapes = sharded.model_keys(point.path / "actor")
    found: dict[str, dict[str, str]] = {}
    for key in shapes:
        m = _ADAPTER_KEY.match(key)
        if m is None:
            raise CheckpointError(f"checkpoint {point.path} is marked adapter-only but its actor holds {key}, which "
                                  "is not a LoRA adapter weight (lora_A / lora_B)")
        found.setdefault(m.group(1), {})[m.group(2)] = key
    incomplete = [mod for mod, ab in found.items() if set(ab) != {"A", "B"}]
    if incomplete or not found:
        raise CheckpointError(f"checkpoint {point.path}: " + (f"{incomplete[0]} has only one of lora_A / lora_B"
                                                              if incomplete else "no LoRA adapter weights"))
    return shapes, {mod: (ab["A"], ab["B"]) for mod, ab in found.items()}


def base_dir(point: Checkpoint, base: Optional[str]) -> Path:
    """The frozen base's directory: ``base`` when given, else the one recorded at save time."""
    path = Path(base or point.meta.get("base_model") or "")
    if not (path / "config.json").is_file():
        where = "--base" if base else "actor.model.path when it was saved"
        raise CheckpointUsageError(f"the base model of LoRA checkpoint {point.path} is not at {path} ({where}, no "
                              "config.json): pass the base model's directory with --base")
    return path


def write_adapter(point: Checkpoint, out: Path, target: Optional[torch.dtype], base: Optional[str]) -> dict:
    """PEFT's ``adapter_model.safetensors`` and ``adapter_config.json`` into ``out``."""
    shapes, modules = adapter_modules(point)
    tensors = sharded.load_tensors(point.path / "actor", shapes)
    peft_names = {k: PEFT_PREFIX + k.replace(f".{ADAPTER}.", ".") for k in tensors}
    tensors = {peft_names[k]: (v.to(target) if target is not None else v) for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_config(point, sorted(modules), str(Path(base).resolve()) if base else point.meta.get("base_model"))
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return {"params": sum(t.numel() for t in tensors.values()),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."), "files": 1}


def peft_config(point: Checkpoint, modules: list[str], base: str) -> dict:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (PEFT's own ``LoraConfig``
    and its ``save_pretrained`` steps; sets as sorted lists, so the file is reproducible)."""
    from peft import LoraConfig  # PEFT imports accelerate: only LoRA exports pay for it

    lora = point.meta.get("lora") or {}
    try:
        alpha = lora["alpha"]
        targets = lora["target_modules"]
        config = LoraConfig(r=lora["rank"], lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
                            lora_dropout=lora["dropout"], task_type="CAUSAL_LM", inference_mode=True,
                            base_model_name_or_path=base,
                            # all-linear is resolved to module paths when PEFT injects; it saves those
                            target_modules=modules if targets == ["all-linear"] else list(targets))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {point.path}: unreadable LoRA settings in its marker ({e})") from None
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def merged_weights(point: Checkpoint, base: Optional[str], config: dict) -> tuple[Shapes, Reader]:
    """The merged policy's weight names with (shape, dtype), and a reader of a group of them.
    Adapted weights are merged in float32 (the precision the policy trained in), so every
    floating weight is float32 unless the export asks for another dtype."""
    shapes, modules = adapter_modules(point)
    root = base_dir(point, base)
    files = _weight_files(root)
    tied = bool(config.get("tie_word_embeddings"))
    names: Shapes = {}
    for key, file in files.items():
        if tied and key == "lm_head.weight":
            continue  # the same tensor as the input embeddings; from_pretrained re-ties it
        with safe_open(str(file), framework="pt") as f:
            names[key] = (tuple(f.get_slice(key).get_shape()), torch.float32)
    lora = point.meta.get("lora") or {}
    scale = float(lora.get("alpha", 0)) / max(int(lora.get("rank", 0)), 1)
    for mod, (a, b) in modules.items():
        weight = f"{mod}.weight"
        if weight not in names:
            raise CheckpointError(f"the base model at {root} has no {weight} for the adapter on {mod} of checkpoint "
                                  f"{point.path}" + (" (the output head is tied to the embeddings)" if tied else ""))
        want = (tuple(shapes[b].size)[0], tuple(shapes[a].size)[1])
        if names[weight][0] != want:
            raise CheckpointError(f"the base model at {root} does not match checkpoint {point.path}: {weight} has "
                                  f"shape {names[weight][0]}, its adapter needs {want}")

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for file in dict.fromkeys(files[k] for k in keys):
            with safe_open(str(file), framework="pt") as f:
                for key in (k for k in keys if files[k] == file):
                    t = f.get_tensor(key)
                    out[key] = t.float() if t.is_floating_point() else t
        out = {k: out[k] for k in keys}
        adapted = [k[:-len(".weight")] for k in keys if k.endswith(".weight") and k[:-len(".weight")] in modules]
        ab = sharded.load_tensors(point.path / "actor", {n: shapes[n] for m in adapted for n in modules[m]})
        for m in adapted:
            a, b = modules[m]
            out[f"{m}.weight"] += scale * (ab[b].float() @ ab[a].float())  # as PEFT merges: W + scale * B @ A
        return out

    return names, read


def _weight_files(root: Path) -> dict[str, Path]:
    """Each weight of the base's safetensors files, and the file that holds it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read {index}: {type(e).__name__}: {e}") from None
        return {k: root / v for k, v in weight_map.items()}
    single = root / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"the base model at {root} has no safetensors weights (model.safetensors or "
                          "model.safetensors.index.json): a merged export reads the base from them")
