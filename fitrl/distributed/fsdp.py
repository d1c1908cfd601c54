"""FSDP2 on one rank: sharding, the rank-0 weight broadcast and gathering a model.

Primitives of the FSDP2 sharding backend: imported only by fitrl/sharding/fsdp2/ (the seam the
rest of fitrl uses is fitrl/distributed/sharding.py).

Model-agnostic: which blocks become FSDP units is the caller's choice (a model family's
``blocks_to_shard``, see :mod:`fitrl.models.families`), and the settings are duck-typed
(:class:`ShardSettings`; ``fitrl.config.FSDPConfig`` fits) so this layer needs no config.

Sharding (:func:`shard`): ``fully_shard`` each given block, then the root, on a 1-D mesh (full
shard) or a 2-D (replicate, shard) mesh (hybrid: shard within a node, replicate across nodes).
Losses use global token counts (all-reduced), so gradients are *summed* across ranks: FSDP's
default division by the world size is switched off (``set_gradient_divide_factor(1)``).

Rank-0 initialisation (:func:`broadcast_from_rank0`): a model built on the ``meta`` device and
sharded allocates its shards (``to_empty``) and receives rank 0's full weights
(``set_model_state_dict(..., broadcast_from_rank0=True)``); buffers that are not in the state
dict (rotary ``inv_freq``) are broadcast too.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard



class ShardSettings(Protocol):
    """What :func:`shard` reads (``fitrl.config.FSDPConfig`` has these fields)."""

    strategy: str  # "full" or "hybrid"
    mixed_precision: bool  # bf16 parameters in compute, fp32 gradient reduction
    cpu_offload: bool  # shards live on the host (FSDP2's CPUOffloadPolicy)


def shard(m: nn.Module, settings: ShardSettings, modules_to_wrap: Iterable[nn.Module], device: torch.device, *,
          nnodes: int = 1) -> None:
    """``fully_shard`` each of ``modules_to_wrap`` (one FSDP unit each), then ``m`` itself.

    Needs a process group. ``nnodes > 1`` with ``strategy="hybrid"`` shards within a node and
    replicates across nodes (world size divisible by ``nnodes``)."""
    world = dist.get_world_size()
    if settings.strategy == "hybrid" and nnodes > 1:
        mesh = init_device_mesh(device.type, (nnodes, world // nnodes), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if settings.mixed_precision
          else MixedPrecisionPolicy())
    # pin_memory needs an accelerator: on a CPU-only machine CPUOffloadPolicy(pin_memory=True) fails
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if settings.cpu_offload else OffloadPolicy()
    for block in modules_to_wrap:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(m, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in fsdp_modules(m):
        module.set_gradient_divide_factor(1.0)
        # plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling
        module.set_force_sum_reduction_for_comms(True)


def broadcast_from_rank0(m: nn.Module, full_state: Optional[dict[str, torch.Tensor]], source: Optional[nn.Module],
                         device: torch.device, *, cpu_offload: bool = False) -> None:
    """Fill a sharded ``meta``-device model with rank 0's weights (collective on every rank).

    Rank 0 passes ``full_state`` (its loaded model's state dict) and ``source`` (that model, for
    the buffers); the other ranks pass ``None`` for both. ``device`` is the compute device;
    with ``cpu_offload`` (as given to :func:`shard`) the shards are materialised in host memory,
    where FSDP2's CPU offloading requires them. Buffers end on ``device`` either way, where
    ``fully_shard`` puts them when every rank reads the checkpoint."""
    m.to_empty(device=torch.device("cpu") if cpu_offload else device)
    set_model_state_dict(m, full_state if full_state is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _broadcast_buffers(m, source, device)


def _broadcast_buffers(m: nn.Module, source: Optional[nn.Module], device: torch.device) -> None:
    """Buffers are replicated, not sharded, and some are not in the state dict (rotary
    ``inv_freq``): rank 0 copies them from the loaded model, then broadcasts them on ``device``
    (NCCL sends device tensors only), where they stay."""
    src = dict(source.named_buffers()) if source is not None else {}
    for name, buf in list(m.named_buffers()):
        sent = buf.to(device)  # ``buf`` itself unless it was materialised in host memory
        if name in src:
            sent.copy_(src[name])
        dist.broadcast(sent, src=0)
        if sent is not buf:
            owner, _, leaf = name.rpartition(".")
            setattr(m.get_submodule(owner), leaf, sent)


def fsdp_modules(m: nn.Module) -> list[nn.Module]:
    """The FSDP units in ``m`` (empty for a plain module)."""
    return [x for x in m.modules() if isinstance(x, FSDPModule)]


@contextmanager
def gathered_for_generation(m: nn.Module) -> Iterator[None]:
    """Full parameters for the length of a ``generate`` call, released afterwards.

    Ranks generate different numbers of tokens; with per-layer all-gathers in every forward
    they would have to step in lockstep. Gathering once up front lets each rank decode on its
    own, at the cost of one full copy of the weights during generation. A no-op on a plain module.
    """
    modules = fsdp_modules(m)
    if not modules:
        yield
        return
    # FSDP2 picks its root at the first forward, which must be the root's. A vision-language
    # model's ``generate`` encodes the images (vision blocks are FSDP units) before its first
    # root forward, so the root is fixed here, as that forward would (private API: torch 2.13).
    m._get_fsdp_state()._lazy_init()
    for x in modules:
        x.set_reshard_after_forward(False, recurse=False)
        x.unshard()
    try:
        yield
    finally:
        for x in modules:
            x.reshard()
            x.set_reshard_after_forward(True, recurse=False)
