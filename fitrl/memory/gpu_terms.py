"""What a GPU run holds that no GPU has measured yet, as named entries of the plan's table.

Each entry's name ends in "assumed)" (:func:`is_assumed`): its size is a constant of
fitrl/memory/calibration.py ("device (GPU): assumed, to be measured") or a closed form resting
on one, which ``make gpu-check`` measures on the next GPU. They exist only on ``device=cuda``
plans, so a CPU plan is unchanged by them (``bench/plan_snapshot.py``):

- :data:`NCCL`: each NCCL communicator's buffers on a rank's device, outside PyTorch's caching
  allocator (:func:`nccl_buffers`; a vLLM TP worker's in the engine's entries while it sleeps);
- :data:`ENGINE_ASLEEP`: a sleeping vLLM engine's CUDA-graph pools and buffers, in every phase
  it sleeps through, loading included (it sleeps right after it is built when the trainer's
  roles share its devices: fitrl/rollout/vllm_plan.py);
- :data:`PINNED_ROUNDING` and :data:`PINNED_CACHE`: AdamW's moments offloaded into pinned host
  blocks, rounded up to a power of two per shard and cached for the whole run
  (:func:`pinned_optimizer`);
- :data:`DRIVER_CONTEXT`: the Ray driver's CUDA context, 0 (it never touches ``torch.cuda``).

A rank's own CUDA context is measured (:data:`~fitrl.memory.calibration.CUDA_CONTEXT`, one per
process on a device) and not repeated here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from fitrl.memory import calibration as C
from fitrl.memory.roles import ROLE_PLANNERS
from fitrl.memory.sharding import sharding_plan

if TYPE_CHECKING:
    from fitrl.memory.model import Usage
    from fitrl.memory.run import Run
    from fitrl.memory.states import States

NCCL = "NCCL buffers (assumed)"
ENGINE_ASLEEP = "engine asleep (CUDA graphs, buffers, assumed)"
PINNED_ROUNDING = "pinned rounding ({}optimizer, assumed)"
"""Host: what the power-of-two blocks of the offloaded moments hold beyond their bytes."""
PINNED_CACHE = "pinned cache ({}optimizer, assumed)"
"""Host, in the update (moments on the device): the cached pinned blocks they left."""
DRIVER_CONTEXT = "driver cuda context (assumed)"

OUTSIDE_ALLOCATOR = ("cuda context", NCCL)
"""Device entries of a rank that PyTorch's caching allocator does not hold (NCCL allocates its
buffers itself): the allocator's reserve factor does not apply to them."""


def is_assumed(component: str) -> bool:
    """Whether a plan entry is one of these terms (a constant no GPU has measured yet)."""
    return component.endswith("assumed)")


def communicators(run: Run, roles: Iterable[tuple[str, object]]) -> int:
    """NCCL communicators one rank's process holds: under Ray on CUDA with more than one rank,
    its default group (each role's worker group is a ``torch.distributed`` world of its own:
    fitrl/distributed/process_group.py)
    and each role's own groups (:meth:`~fitrl.memory.roles.RolePlanner.communicators`: a hybrid
    mesh's two, the policy's sequence-parallel group). Beside them, with any number of ranks, the weight
    channel's to rollout workers of their own (:meth:`~fitrl.memory.roles.RolePlanner.channel_communicators`:
    the policy's rank and each worker). ``roles``: (name, config section) of the process's roles."""
    if not (run.cuda and run.distributed):
        return 0
    planners = [(ROLE_PLANNERS.get(name), section) for name, section in roles]
    channel = sum(p.channel_communicators(run) for p, _ in planners)
    if run.world <= 1 or not any(p.process_group for p, _ in planners):
        return channel
    return 1 + sum(p.communicators(run, section) for p, section in planners if p.process_group) + channel


def nccl_buffers(run: Run, roles: Iterable[tuple[str, object]]) -> int:
    """Device bytes of a rank's NCCL communicators (:func:`communicators` x
    :data:`~fitrl.memory.calibration.NCCL_COMMUNICATOR_BYTES`), in every phase: NCCL allocates a
    communicator's buffers at its first collective (the rank-0 broadcast of the load, FSDP2's
    first all-gather) and keeps them until the process ends."""
    return communicators(run, roles) * C.NCCL_COMMUNICATOR_BYTES


def pinned_optimizer(run: Run, section, full: States, st: States, opt_on_device: bool, u: Usage, label: str) -> None:
    """AdamW's moments under ``offload_optimizer`` on CUDA: moved to the host with
    ``non_blocking=True`` (fitrl/distributed/host_device.py, ``move_optimizer_state``), which pins the
    copy (torch's ``_to_copy``), so they live in the caching host allocator's blocks: each shard
    rounded up to a power of two (:data:`~fitrl.memory.calibration.PINNED_POWER_OF_TWO`) and kept
    cached when the moments go back to the device. Offloaded, the host holds the blocks: the
    moments' bytes (the "offloaded optimizer" entry) and :data:`PINNED_ROUNDING` on top; in the
    update, the moments on the device, the cached blocks (:data:`PINNED_CACHE`). A 7B on 8 ranks:
    13.5 GiB per rank where its bytes are 7.1 GiB (116 GB per node against 61 GB).

    Not under FSDP2's ``cpu_offload``: there the moments are created on the host by AdamW's
    ``zeros_like`` of the pinned shards (pageable) and never move (its pinned weights and gradients
    are rounded in their own entries: fitrl/memory/states.py). ``full``: the role's states in the
    update; ``st``: what it holds in this phase (no optimizer while loading)."""
    sh = sharding_plan(section)
    if not (run.cuda and sh.offloads(section, "optimizer") and st.optimizer) or sh.host_only(run, section):
        return
    if opt_on_device:
        u.add("host", PINNED_CACHE.format(label), full.optimizer_pinned)
    else:
        u.add("host", PINNED_ROUNDING.format(label), full.optimizer_pinned - full.optimizer)


def assumed_parts(parts: dict[str, int]) -> dict[str, int]:
    """The assumed entries of a device's or a node's parts (:meth:`~fitrl.memory.model.Plan.device`,
    :meth:`~fitrl.memory.model.Plan.node_host`)."""
    return {k: v for k, v in parts.items() if is_assumed(k)}
