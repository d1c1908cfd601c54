"""How a role's model is spread over the ranks of its process group: the seam a sharding backend
plugs into (FSDP2 is the built-in one, fitrl/sharding/fsdp2/; docs/architecture.md, "Adding a
sharding backend").

A role's config section names its backend (``actor.sharding: fsdp2``) and keeps that backend's
options in a section of their own (:attr:`ShardingBackend.options_key`: ``actor.fsdp``). Code
outside the backend's folder never imports its primitives: it asks

- the backend by name (:func:`sharding_backend`) to shard a model it builds (fitrl/models/loading.py);
- the model itself (:func:`backend_of`) whether it is sharded, for its units, for its full weights
  during a ``generate`` call.

A plain module (one process, a rollout worker's replica) is owned by no backend and answers as a
whole module: no units, nothing to gather. Each backend has its memory planner beside it, under
the same name (fitrl/memory/sharding.py; ``missing_counterparts`` in fitrl/trainer/complete.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fitrl.core.registry import Registry
from fitrl.distributed.collectives import distributed


class ShardingBackend:
    """One way of sharding a model over a process group. The defaults describe a whole module on
    every rank (nothing sharded, nothing to gather): a backend overrides what it changes."""

    name = "plain"
    options_key = ""
    """The role section's attribute holding this backend's options (``fsdp``)."""

    def options(self, section: Any) -> Any:
        """This backend's options in a role's config section (``cfg.actor`` -> ``cfg.actor.fsdp``)."""
        return getattr(section, self.options_key) if self.options_key else None

    def owns(self, m: nn.Module) -> bool:
        """Is ``m`` (or a module inside it, under a LoRA wrapper) sharded by this backend?"""
        return False

    def reads_checkpoint_once(self, options: Any) -> bool:
        """Does one rank read the checkpoint and fill the others (:meth:`fill_from_rank0`)? Then
        the other ranks build the model on the ``meta`` device (no weights in memory)."""
        return False

    def shard(self, m: nn.Module, options: Any, blocks: Iterable[nn.Module], device: torch.device, *,
              nnodes: int = 1) -> None:
        """Shard ``m`` in place over the process group; ``blocks``: the model family's units
        (its decoder layers, vision blocks), sharded and gathered one at a time."""

    def fill_from_rank0(self, m: nn.Module, full_state: Optional[dict[str, torch.Tensor]],
                        source: Optional[nn.Module], device: torch.device, options: Any) -> None:
        """After :meth:`shard` of a ``meta`` model: allocate it and fill it with rank 0's weights
        (rank 0 passes its loaded state and model, the others None; collective)."""
        raise NotImplementedError(f"sharding backend {self.name!r} reads the checkpoint on every rank")

    def units(self, m: nn.Module) -> list[nn.Module]:
        """The modules gathered as one (empty: nothing is sharded)."""
        return []

    def gathered_for_generation(self, m: nn.Module) -> ContextManager[None]:
        """Full parameters for the length of a ``generate`` call (ranks decode different numbers
        of tokens, so they cannot step through per-layer gathers in lockstep)."""
        return nullcontext()


PLAIN = ShardingBackend()

SHARDING_BACKENDS: Registry[ShardingBackend] = Registry("sharding backend", "actor.sharding")
"""The built-in backends register when :mod:`fitrl.sharding` is imported (the command line, the
roles and the planner import it); the config's ``<role>.sharding`` names are checked against it
when a config loads (fitrl/config/choices.py)."""


def sharding_backend(name: str, key: str = "actor.sharding") -> ShardingBackend:
    """The backend registered as ``name``; ``key`` names the setting in the error."""
    if not SHARDING_BACKENDS.names():
        raise RuntimeError("no sharding backend is registered: import fitrl.sharding first (a bug in fitrl)")
    SHARDING_BACKENDS.check(name, key)
    return SHARDING_BACKENDS.get(name)


def backend_of(m: nn.Module) -> ShardingBackend:
    """The backend that sharded ``m``; :data:`PLAIN` for a module no backend owns."""
    for name in SHARDING_BACKENDS.names():
        backend = SHARDING_BACKENDS.get(name)
        if backend.owns(m):
            return backend
    return PLAIN


def sharding_units(m: nn.Module) -> list[nn.Module]:
    """The units ``m``'s backend gathers one at a time (empty for a plain module)."""
    return backend_of(m).units(m)


def sharded_over_ranks(m: nn.Module) -> bool:
    """Is ``m`` sharded over more than one rank? Then every forward of a sharded layer is a
    collective, which all ranks must run alike."""
    return distributed() and dist.get_world_size() > 1 and bool(sharding_units(m))


def gathered_for_generation(m: nn.Module) -> ContextManager[None]:
    """``m``'s full weights for one ``generate`` call (a no-op on a plain module)."""
    return backend_of(m).gathered_for_generation(m)
