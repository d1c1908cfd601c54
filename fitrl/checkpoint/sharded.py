"""One role's training state on one rank, saved and loaded with torch.distributed.checkpoint.

Layout of a role's directory (``step_N/actor``)::

    .metadata            global shapes of every tensor and where each shard lies (DCP)
    __<rank>_0.distcp    the shards rank <rank> held: model weights and AdamW moments
    role_state.pt        scheduler, update counter (identical on every rank; rank 0 writes it)
    rng_rank<r>.pt       rank r's torch generators (rollouts sample with them)

With ``keep`` (a LoRA policy: the names of its trained parameters, from
``ParameterSet.trained_names`` in fitrl/models/params.py) only those weights are saved and
loaded, with their optimizer states: the frozen base is not in the checkpoint, it is rebuilt
from the model path.

Saving is sharded: under FSDP2 ``get_state_dict`` hands out each rank's DTensor shards and
every rank writes only its own file, so no rank ever holds the full model (host memory while
saving stays ~ one tensor's staging copy, see bench/checkpoint_save.py). Loading goes through
the global shapes in ``.metadata``, so a checkpoint written by N ranks loads into M ranks (or
one process without a process group): DCP reads the overlapping pieces of each shard.

Before anything is read every rank checks, the same way, that the checkpoint's tensors match
the model's names and shapes and that every shard file is there and long enough; so a bad
checkpoint fails on all ranks with the same message instead of hanging a collective.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from fitrl.checkpoint import rng
from fitrl.checkpoint.layout import CheckpointError
from fitrl.core.faults import own_disk

METADATA = ".metadata"
ROLE_STATE = "role_state.pt"


def rng_file(rank: int) -> str:
    """The file of rank ``rank``'s generators in a role's directory."""
    return f"rng_rank{rank}.pt"


@contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_role(path: str | Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
              extra: Optional[dict], *, rank: int, keep: Optional[set[str]] = None) -> None:
    """Write this rank's shards of ``model`` (and ``optimizer``) plus its generators into ``path``;
    only the weights named in ``keep`` when given. A collective under a process group: every rank
    calls it with the same ``path``."""
    path = own_disk(path, "checkpoint")  # (the path itself unless a test gives this rank a disk of its own)
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": model_state(model, keep)}
    # An optimizer that has not stepped yet (critic warm-up) has no state to save, and
    # get_optimizer_state_dict would create it with a fake zero-lr step, changing the run.
    if optimizer is not None and optimizer.state:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(path))
    torch.save(rng.torch_state(), path / rng_file(rank))
    if rank == 0 and extra is not None:
        torch.save(extra, path / ROLE_STATE)


def load_role(path: str | Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], *,
              rank: int, what: str, keep: Optional[set[str]] = None, hint: str = "") -> Optional[dict]:
    """Load ``path`` into ``model`` (and ``optimizer`` when given and saved) in place, restore
    this rank's generators when the checkpoint has them, and return ``role_state.pt`` (or None).
    ``what`` names the model in messages (``actor.model.path=/data/Qwen``); ``keep``: the weights
    the checkpoint holds (as saved with it), the rest of the model stays as built; ``hint`` ends
    the message when the checkpoint's weight names are not the model's."""
    path = Path(path)
    meta = read_metadata(path)
    check_files(path, meta)
    template = {"model": model_state(model, keep)}
    check_shapes(path, meta, template["model"], what, hint)
    if optimizer is not None and any(k.startswith("optim.") for k in meta.state_dict_metadata):
        template["optim"] = get_optimizer_state_dict(model, optimizer)
    try:
        with _quiet_single_process():
            dcp.load(template, checkpoint_id=str(path))
    except Exception as e:  # a corrupt shard surfaces as whatever torch.load raised
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    set_model_state_dict(model, template["model"], options=StateDictOptions(strict=keep is None))
    if "optim" in template:
        set_optimizer_state_dict(model, optimizer, template["optim"])
    mine = path / rng_file(rank)
    if mine.is_file():  # absent when this run has more ranks than the saving one
        rng.set_torch_state(torch.load(mine, weights_only=True))
    role_state = path / ROLE_STATE
    return torch.load(role_state, weights_only=True) if role_state.is_file() else None


def model_state(model: torch.nn.Module, keep: Optional[set[str]]) -> dict:
    """The model's state dict (under FSDP2: this rank's shards, no gather), only ``keep``'s keys
    when given."""
    state = get_model_state_dict(model)
    if keep is None:
        return state
    unknown = sorted(keep - set(state))
    if unknown:  # the names of named_parameters() and of the state dict disagree: a wrapper renamed them
        raise CheckpointError(f"{len(unknown)} trained parameter(s) have no state-dict key of the same name "
                              f"(e.g. {unknown[0]}): cannot tell which weights a checkpoint must hold")
    return {k: v for k, v in state.items() if k in keep}


def read_metadata(path: Path):
    if not (path / METADATA).is_file():
        raise CheckpointError(f"checkpoint {path} has no {METADATA} (not a torch.distributed.checkpoint directory, "
                              "or its save was interrupted)")
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read {path / METADATA}: {type(e).__name__}: {e}") from e


def shard_ends(meta) -> dict[str, int]:
    """Every shard file the metadata points into, with the bytes it must hold at least."""
    needed: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def check_files(path: Path, meta) -> None:
    """Every shard file the metadata points into exists and is long enough."""
    for rel, end in sorted(shard_ends(meta).items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing shard file {rel} (one rank's part of the weights "
                                  "and optimizer state)")
        size = f.stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint shard {f} is truncated: {size} bytes, its metadata needs {end}")


def check_shapes(path: Path, meta, model_state: dict, what: str, hint: str = "") -> None:
    """The checkpoint's weights are this model's: same names, same global shapes."""
    saved = {k[len("model."):]: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    missing = [k for k in model_state if k not in saved]
    extra = [k for k in saved if k not in model_state]
    where = f"{path / METADATA}"
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are not in it (e.g. {missing[0]})")
        if extra:
            parts.append(f"it has {len(extra)} tensors the model lacks (e.g. {extra[0]})")
        raise CheckpointError(f"checkpoint {where} does not match {what}: " + "; ".join(parts)
                              + (f" ({hint})" if hint else ""))
    for k, t in model_state.items():
        s = saved[k]
        if isinstance(s, TensorStorageMetadata) and tuple(s.size) != tuple(t.shape):  # DTensor: global shape
            raise CheckpointError(f"checkpoint {where} does not match {what}: {k} has shape {tuple(s.size)} in the "
                                  f"checkpoint but {tuple(t.shape)} in the model")


def model_keys(path: Path) -> dict[str, TensorStorageMetadata]:
    """Weight names and their metadata (global shape, dtype), for export without a model."""
    meta = read_metadata(path)
    check_files(path, meta)
    return {k[len("model."):]: v for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def load_tensors(path: Path, shapes: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """Read the named weights (full tensors) in one process, nothing else: used per output
    shard by export, so memory stays one shard's worth."""
    state = {"model": {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in shapes.items()}}
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    return state["model"]
