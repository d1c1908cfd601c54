"""Every model a config names, resolved once before anything loads: a local directory as it is,
or a Hugging Face Hub id (``org/name``, ``org/name@revision``; fitrl/core/hub.py) as a snapshot
directory of the standard cache.

- :func:`resolve_run_refs` (``fitrl train``, ``fitrl sft``, ``fitrl.train``; called by
  fitrl/trainer/run.py right after the run directory is locked, before any check, plan, reward
  process or rank): each model the run loads is downloaded into the cache (online and not
  ``HF_HUB_OFFLINE``) or found there, and its setting is replaced by the snapshot's directory,
  so the checks, the plan and every rank (which receive the config) read a local directory. A
  model the run does not build (a reference without KL, a critic without ``gae``) gets only its
  ``config.json``, which the plan reads; a teacher while distillation is off
  (``algorithm.distill.weight=0``: neither built nor planned) is left as it is. The Hub datasets of ``data.*_files`` are checked
  (fitrl/data/hub.py). What was resolved is written to ``<run dir>/hub_refs.json`` (the id, the
  revision asked for, its commit, the directory), and a later launch in the same run directory
  (a resume) uses the recorded commits: a branch that moved since does not change the weights
  under a resumed run. A note at start-up says what each id resolved to.
- :func:`resolve_plan_refs` (``fitrl plan``): only ``config.json`` of each model (and a
  vision-language model's image processor config when it has one; the tokenizer's files when
  the plan samples prompt lengths from local data), never a weight file, so a 72B model is
  planned after fetching a few kilobytes; nothing of a teacher the plan leaves out (distillation off).
- :func:`resolve_base` (``fitrl export --base``).
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from fitrl.config.roles import ModelConfig
from fitrl.config.schema import adjusted
from fitrl.core import hub
from fitrl.core.errors import ModelDirError, UserError
from fitrl.data.hub import parse_dataset_ref, resolve_dataset
from fitrl.models.config_json import read_config_json
from fitrl.models.vl_types import IMAGE_PROCESSOR_FILE, is_vision_language

RECORD = "hub_refs.json"
"""In the run directory: what each Hub id of the run resolved to."""
NOT_LOADED = ("original/*", "*.pth", "*.pt", "*.ckpt", "*.onnx", "*.onnx_data", "onnx/*", "*.gguf", "*.h5",
              "*.msgpack", "*.ot", "*.tflite", "*.mlmodel", "coreml/*", "openvino/*")
"""Files of a model repository that transformers does not load (other formats, the original
release's checkpoints): never downloaded."""
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def model_settings(cfg: Any, prefix: str = "") -> Iterator[tuple[str, ModelConfig]]:
    """``(key, ModelConfig)`` of every model the config names (``actor.model``,
    ``reward.sources.rm.model``, ...): found by walking the config, so a section that gains a
    model (a teacher) is resolved without a list here to keep."""
    if isinstance(cfg, ModelConfig):
        yield prefix, cfg
    elif is_dataclass(cfg) and not isinstance(cfg, type):
        for f in fields(cfg):
            yield from model_settings(getattr(cfg, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(cfg, dict):
        for k, v in cfg.items():
            yield from model_settings(v, f"{prefix}.{k}")


def resolve_run_refs(cfg: Any, run_dir: Optional[Path] = None) -> dict[str, dict]:
    """Resolve the run's Hub ids (models and datasets) in place; returns and records what they
    resolved to (``{}`` when the config names local paths only: nothing is written)."""
    recorded = _recorded(run_dir)
    built, unused = _built_models(cfg), _unused_models(cfg)
    records: dict[str, dict] = {}
    for prefix, model in model_settings(cfg):
        if id(model) in unused:
            continue
        for attr in ("path", "tokenizer_path"):
            text = getattr(model, attr)
            ref = hub.parse_model_ref(text)
            if ref is None:
                continue
            key = f"{prefix}.{attr}"
            what = f"{key}={text!r}"
            old = recorded.get(key) or {}
            pin = old.get("commit") if (old.get("id"), old.get("revision")) == (ref.repo_id, ref.revision or "main") \
                else None
            if attr == "tokenizer_path":
                snap, _ = hub.snapshot(ref, what, pin=pin, allow=hub.TOKENIZER_PATTERNS)
            elif id(model) in built:
                snap = _with_weights(ref, what, pin)
            else:  # named but not built by this run: the plan reads its config.json, nothing else does
                snap = hub.files(ref, what, ["config.json"], pin=pin)
            setattr(model, attr, str(snap.path))
            records[key] = snap.record()
            adjusted(cfg, f"{key}={text} is {snap.path} (commit {snap.commit[:8]}"
                          f"{', as this run directory recorded' if pin else ''}; from the Hugging Face cache)")
    data = cfg.data
    entries = ([] if cfg.trainer.val_only else [("train_files", f) for f in data.train_files]) + \
        [("val_files", f) for f in data.val_files]
    counts: dict[str, int] = {}
    for name, entry in entries:
        i = counts[name] = counts.get(name, -1) + 1
        ref = parse_dataset_ref(entry)
        if ref is not None:
            key = f"data.{name}[{i}]"
            old = recorded.get(key) or {}
            pin = old.get("commit") if old.get("id") == ref.repo.repo_id else None
            records[key] = resolve_dataset(ref, key, pin=pin, fresh=True).record()
    if records and run_dir is not None:
        _record(Path(run_dir), {**recorded, **records})
    return records


def resolve_plan_refs(cfg: Any) -> None:
    """The config's Hub models as directories holding what ``fitrl plan`` reads: ``config.json``,
    a vision-language model's image processor config (when it has one), and the tokenizer's files
    when the plan samples prompt lengths from local data (``plan.expected_prompt_length=auto``).
    No weight file."""
    d = cfg.data
    sample = (cfg.plan.expected_prompt_length == "auto" and bool(d.train_files)
              and all(os.path.exists(f) for f in d.train_files))
    unused = _unused_models(cfg)
    for prefix, model in model_settings(cfg):
        if id(model) in unused:
            continue
        ref = hub.parse_model_ref(model.path)
        tokenizer = sample and prefix == "actor.model"
        if ref is not None:
            what = f"{prefix}.path={model.path!r}"
            snap = hub.files(ref, what, ["config.json"], hub.TOKENIZER_FILES if tokenizer and not model.tokenizer_path
                             else ())
            config = read_config_json(snap.path / "config.json", f"{prefix}.path")
            if is_vision_language(str(config.get("model_type", ""))):  # pixels -> tokens: its patching, if
                hub.files(ref, what, [], [IMAGE_PROCESSOR_FILE], pin=snap.commit)  # there (else the defaults)
            model.path = str(snap.path)
        tok = hub.parse_model_ref(model.tokenizer_path)
        if tok is not None and tokenizer:
            try:  # (best effort: without it the plan takes the prompt cap, and says so)
                model.tokenizer_path = str(hub.files(tok, f"{prefix}.tokenizer_path", ["tokenizer_config.json"],
                                                     hub.TOKENIZER_FILES).path)
            except UserError:
                pass


def resolve_base(base: Optional[str], *, weights: bool = True) -> Optional[str]:
    """``fitrl export --base``: a Hub id as its snapshot directory (with the weights a merge
    reads, or ``config.json`` alone); a local path as it is."""
    ref = hub.parse_model_ref(base)
    if ref is None:
        return base
    what = f"--base {base!r}"
    return str((_with_weights(ref, what) if weights else hub.files(ref, what, ["config.json"])).path)


def _with_weights(ref: hub.HubRef, what: str, pin: Optional[str] = None) -> hub.Snapshot:
    """The whole model (config, weights in one format, tokenizer, processor) in the cache."""
    snap, names = hub.snapshot(ref, what, pin=pin, ignore=_not_loaded)
    present = [p.name for p in snap.path.iterdir()] if snap.path.is_dir() else []
    if names is None and not any(fnmatch.fnmatch(n, w) for n in present for w in WEIGHTS):
        raise ModelDirError(f"{what}: the Hugging Face cache holds {ref} at {snap.commit[:8]} without its weights "
                            f"({', '.join(sorted(present)) or 'no file'}: what `fitrl plan` fetches) and "
                            f"{hub.offline_setting() or 'the Hub could not be reached'}; fill it where the Hub "
                            f"is reachable: `{hub.fill_command(ref)}`")
    return snap


def _not_loaded(names: list[str]) -> list[str]:
    """What not to download of a repository with these files: other formats, and the ``.bin``
    copies of weights that are also in safetensors (transformers reads those)."""
    return [*NOT_LOADED, *(["*.bin"] if any(n.endswith(".safetensors") for n in names) else [])]


def _built_models(cfg: Any) -> set[int]:
    """``id()`` of the model settings whose weights this run loads: every model the walk finds
    except a reference or critic the algorithm does not build (fitrl/models/check.py's list)."""
    from fitrl.models.check import run_models

    loaded = {id(m) for m, _, _ in run_models(cfg)}
    skipped = {id(m) for m in (cfg.ref.model, cfg.critic.model) if m is not None and id(m) not in loaded}
    return {id(m) for _, m in model_settings(cfg)} - skipped


def _unused_models(cfg: Any) -> set[int]:
    """``id()`` of the model settings nothing of the run reads, not even the plan: the teacher
    while distillation is off (``algorithm.distill.weight=0``; fitrl/config/layout.py builds and
    plans it only when on), so a teacher left in a config need not be in the cache."""
    teacher = cfg.teacher.model
    return {id(teacher)} if teacher is not None and not cfg.algorithm.distill.enabled else set()


def _recorded(run_dir: Optional[Path]) -> dict[str, dict]:
    """What an earlier launch in ``run_dir`` resolved (``{}`` without one)."""
    if run_dir is None:
        return {}
    try:
        found = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _record(run_dir: Path, records: dict[str, dict]) -> None:
    tmp = run_dir / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
    tmp.replace(run_dir / RECORD)
