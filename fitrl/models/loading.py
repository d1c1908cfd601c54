"""Loading real Hugging Face checkpoints from local directories, and building a role's model on one rank.

The demo's tiny models and a user's Qwen2.5-7B go through exactly this code; nothing here
reaches a hub (``local_files_only``), so a wrong path fails fast with a clear message.

:func:`build_model` asks the checkpoint's model family (:mod:`fitrl.models.families`) how to
build the model and which blocks to shard. Without a process group (the in-process backend) a
model is simply loaded. Under ``torch.distributed`` (the Ray backend) the order is fixed, as
in torchtitan:

  1. every rank builds the architecture on the ``meta`` device (no memory);
     with ``init=rank0`` only rank 0 also reads the checkpoint (one full copy on the host);
     with ``init=every_rank`` every rank reads it (one full copy per rank: the slow path, kept
     as an option; see docs/architecture.md, "Failure stories");
  2. gradient checkpointing is switched on (it wraps layers, so before sharding);
  3. the family's blocks, then the root, are sharded by the role's sharding backend (its
     ``sharding`` setting, FSDP2 by default: fitrl/distributed/sharding.py);
  4. meta ranks allocate their shards and rank 0 fills them with the weights and buffers
     (where the backend's options say one rank reads the checkpoint).
"""

from __future__ import annotations

import socket
from typing import Any, Optional

import torch
from torch import nn

from fitrl.config.schema import ModelConfig
from fitrl.core.errors import ModelDirError
from fitrl.core.faults import own_disk
from fitrl.distributed.collectives import distributed, rank
from fitrl.distributed.sharding import sharding_backend
from fitrl.models.check import load_local_tokenizer
from fitrl.models.description import ModelDescription, RunModels
from fitrl.models.params import ParameterSet
from fitrl.ops.varlen import use_varlen_vision

FULL = ParameterSet()


def check_on_this_node(path: str, key: str) -> None:
    """``path`` (the value of ``key``) is a directory where this process runs. The driver checked
    it on its own node; a rank on another node may lack it (a local disk, a mount missing there):
    a one-line :class:`ModelDirError` naming this host, which the driver re-raises as the same
    type prefixed with the rank and the node's IP (fitrl/workers/ray_group.py), exit 2."""
    if not path:
        return  # (check_path names an empty setting)
    here = own_disk(path, "model")  # (the path itself unless a test gives this rank a disk of its own)
    if here.is_dir():
        return
    state = "is a file, not a directory," if here.exists() else "does not exist"
    raise ModelDirError(f"{key}={path} {state} on host {socket.gethostname()}, where this process runs: every node "
                        f"of a Ray cluster needs it at the same path (shared storage, or a copy on each node; "
                        f"docs/distributed.md)")


def described(models: Optional[RunModels], key: str, model: ModelConfig) -> ModelDescription:
    """The description of ``model`` (config section ``key``, ``ref.model``) from ``models``,
    handed down from ``train()``; without them (a worker built directly), read from its
    directory now, which is checked to be on this node first, as a model to be loaded is.
    Descriptions of another directory than ``model``'s are a
    programming error."""
    found = models.get(key) if models is not None else None
    if found is None:
        check_on_this_node(model.path, f"{key}.path")
        return ModelDescription.read(model, f"{key}.path")
    if found.path != model.path:
        raise ValueError(f"the run's description of {key} is of {found.path!r}, not of {key}.path={model.path!r}")
    return found


def load_tokenizer(model: ModelConfig, key: str = "actor.model"):
    """The tokenizer of ``model`` (``key``: its config section, for messages), checked to be here first."""
    where, setting = (model.tokenizer_path, f"{key}.tokenizer_path") if model.tokenizer_path else (model.path,
                                                                                                   f"{key}.path")
    check_on_this_node(where, setting)
    try:  # transformers imported on use: importing this module (the trainer's config checks) stays cheap
        return load_local_tokenizer(where)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a directory it cannot read
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelDirError(f"cannot load the tokenizer in {where} ({setting}) on host {socket.gethostname()}: "
                            f"{type(e).__name__}: {first}") from None


def build_model(kind: str, model: ModelConfig, section: Any, device: torch.device, *,
                what: str = "actor.model.path", nnodes: int = 1, params: ParameterSet = FULL,
                replicate: bool = False, description: Optional[ModelDescription] = None) -> nn.Module:
    """The role's model on this rank: plain when there is no process group, sharded otherwise
    by the backend ``section.sharding`` names (``section``: the role's config section, ``cfg.actor``).

    ``kind``: ``"causal_lm"`` (policy, reference) or ``"value"`` (critic); ``what`` names the
    config key of ``model.path`` in error messages; ``nnodes`` shapes a hybrid-shard mesh;
    ``params``: which parameters train (LoRA adapters are injected into every copy built here);
    ``replicate``: a whole copy on every rank even under a process group (a rollout worker's);
    ``description``: the model's, read by the driver (fitrl/models/description.py): its family,
    and no ``config.json`` read here (without one it is read, checked, here)."""
    check_on_this_node(model.path, what)
    family = (description or ModelDescription.read(model, what)).family
    load, build = family.builders(kind, model)
    from_pretrained, from_config = (lambda: params.apply(load())), (lambda: params.apply(build()))
    if replicate or not distributed():
        m = from_pretrained().to(device)
        _after_build(m, model, device)
        return m

    backend = sharding_backend(section.sharding, what.rsplit(".model.", 1)[0] + ".sharding")
    options = backend.options(section)
    rank0_init = backend.reads_checkpoint_once(options)
    full_state, source = None, None
    if rank0_init:
        with torch.device("meta"):
            m = from_config()
        if rank() == 0:
            source = from_pretrained()  # the one full copy, on the host
            full_state = source.state_dict()
    else:
        m = from_pretrained()
    _after_build(m, model, device)
    backend.shard(m, options, family.blocks_to_shard(m), device, nnodes=nnodes)
    if rank0_init:
        backend.fill_from_rank0(m, full_state, source, device, options)
        del full_state, source
    return m


def _after_build(m: nn.Module, model: ModelConfig, device: torch.device) -> None:
    """What a built model takes before it is used: its vision tower's kernel, gradient checkpointing."""
    use_varlen_vision(m, device)  # (a vision tower's windows in one kernel call on CUDA; fitrl/ops/varlen.py)
    if model.gradient_checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
