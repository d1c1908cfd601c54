"""Model states in closed form: parameters, gradients and AdamW states per rank.

With fp32 master weights and AdamW a trained model holds 16 bytes per parameter (weights 4,
gradients 4, ``exp_avg`` and ``exp_avg_sq`` 8) plus AdamW's fp32 ``step`` scalar per tensor;
the gradients only during an update (the planner drops them in other phases).
Under FSDP2 each tensor is sharded on dim 0 over the N ranks of its shard group, padded to a
multiple of N: rank 0 (the largest shard) holds ``ceil(dim0 / N) * rest`` elements of each.
A frozen bf16 reference holds 2 bytes per parameter over N. A LoRA policy holds its frozen base
(weights only) and its adapters (16 bytes per adapter parameter). Pinned host memory (FSDP2
``CPUOffloadPolicy`` on CUDA) is rounded up to a power of two per tensor by PyTorch's host
caching allocator.

Hand-checkable: ``shard_numel((10, 3), 4) == 9`` (rows ceil(10/4) = 3, times 3 columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from fitrl.memory import calibration as C
from fitrl.models.shape import ModelShape, numel

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_STEP_BYTES = 4  # AdamW keeps ``step`` as a float32 scalar tensor per parameter tensor


def shard_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's FSDP2 shard of a tensor: dim 0 split in ceil(dim0 / world) rows."""
    if world <= 1:
        return numel(shape)
    rows = -(-shape[0] // world)
    return rows * numel(shape[1:])


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tensors_bytes(shapes: Iterable[tuple[int, ...]], dtype_bytes: int, world: int = 1, pinned: bool = False) -> int:
    """Bytes of rank 0's shards of ``shapes`` (each rounded up to a power of two when pinned)."""
    total = 0
    for s in shapes:
        b = shard_numel(s, world) * dtype_bytes
        total += next_power_of_two(b) if pinned and C.PINNED_POWER_OF_TWO else b
    return total


@dataclass(frozen=True)
class States:
    """Bytes one rank holds for one role's model (0 for what the role does not have)."""
    params: int
    grads: int = 0
    optimizer: int = 0
    optimizer_pinned: int = 0
    """``optimizer`` with each moment's shard in a pinned host block (a power of two: offloaded by
    ``offload_optimizer`` on CUDA, fitrl/memory/gpu_terms.py); not part of :attr:`total`."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def trained_states(shape: ModelShape, world: int = 1, dtype: str = "float32", pinned: bool = False,
                   with_vision: bool = True, frozen_vision: bool = False) -> States:
    """A trained role (actor, critic): weights and gradients in ``dtype``, fp32 AdamW moments.

    With ``pinned`` (FSDP2 CPUOffloadPolicy on CUDA) weights and gradients are pinned host
    tensors, rounded per tensor; AdamW's states are created by ``zeros_like`` of the weights
    (pageable), so they are not. ``frozen_vision`` (``actor.model.freeze_vision_tower``): the
    vision tower keeps its weights but has no gradients, and the optimizer (built over the
    parameters that require grad) no states for it.
    """
    shapes = [s for _, s in shape.tensors(with_vision)]
    trained = [s for _, s in shape.tensors(with_vision and not frozen_vision)]
    b = DTYPE_BYTES[dtype]
    return States(params=tensors_bytes(shapes, b, world, pinned), grads=tensors_bytes(trained, b, world, pinned),
                  optimizer=tensors_bytes(trained, 8, world) + ADAM_STEP_BYTES * len(trained),
                  optimizer_pinned=adam_pinned(trained, world))


def lora_states(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str], world: int = 1,
                dtype: str = "float32", pinned: bool = False) -> States:
    """A LoRA policy (fitrl/models/params.py): every base weight, frozen, plus the adapters in
    ``dtype``; gradients and fp32 AdamW states (``requires_grad`` only) for the adapters alone.
    Sharding and pinning apply tensor by tensor, as for :func:`trained_states`."""
    base = [s for _, s in shape.tensors()]
    adapters = [s for _, s in shape.lora_tensors(rank, targets)]
    b = DTYPE_BYTES[dtype]
    return States(params=tensors_bytes(base, b, world, pinned) + tensors_bytes(adapters, b, world, pinned),
                  grads=tensors_bytes(adapters, b, world, pinned),
                  optimizer=tensors_bytes(adapters, 8, world) + ADAM_STEP_BYTES * len(adapters),
                  optimizer_pinned=adam_pinned(adapters, world))


def adam_pinned(trained: list[tuple[int, ...]], world: int = 1) -> int:
    """AdamW's states of ``trained`` with each fp32 moment (``exp_avg``, ``exp_avg_sq``: one
    shard each per tensor) in a pinned block of its own, rounded up to a power of two; the
    ``step`` scalars as in ``optimizer`` (4 bytes: their rounding is nothing)."""
    return 2 * tensors_bytes(trained, 4, world, pinned=True) + ADAM_STEP_BYTES * len(trained)


def lora_layer_params(shape: ModelShape, rank: int, targets: tuple[str, ...] | list[str]) -> int:
    """Adapter parameters of one decoder layer (gathered with it by FSDP2)."""
    prefix = "model.layers.0."
    return sum(numel(s) for n, s in shape.lora_tensors(rank, targets) if n.startswith(prefix))


def frozen_states(shape: ModelShape, world: int = 1, dtype: str = "bfloat16", pinned: bool = False) -> States:
    """A frozen role (reference): weights only."""
    return States(params=tensors_bytes([s for _, s in shape.tensors()], DTYPE_BYTES[dtype], world, pinned))


def full_weights(shape: ModelShape, dtype: str = "bfloat16", tp: int = 1, pinned: bool = False) -> int:
    """One full copy of the weights (a checkpoint read on the host, an inference engine's copy
    split over ``tp`` tensor-parallel ranks: each rank ~1/tp of every matrix)."""
    return tensors_bytes([s for _, s in shape.tensors()], DTYPE_BYTES[dtype], tp, pinned)


CHANNEL_ALIGN = 16
"""Bytes: where each tensor starts in a weight-channel bucket (fitrl/distributed/weight_sync.py, ``ALIGN``)."""


WEIGHT_CHANNEL = "weight channel bucket"
"""``rollout.weight_transport`` resolved to ``collective``: what a push over the weight channel
holds beyond the weights (:meth:`~fitrl.memory.run.Run.channel_bytes`), on rank 0's device (the
"rank0" process, counted on the device planned: :meth:`~fitrl.memory.model.Plan.device`) and each
rollout worker's, in ``weight_sync``."""


def channel_payloads(shape: ModelShape, dtype_bytes: int, bucket_bytes: int) -> tuple[bool, list[int], int]:
    """One version over the weight channel (``WeightChannel.send``, fitrl/distributed/weight_sync.py)
    in the shape's tensor order: whether rank 0 makes its bucket (``bucket_bytes``, allocated whole
    at the first tensor that fits one) and each broadcast payload's bytes: a packed bucket's (each
    tensor at a 16-byte-aligned offset) or a tensor's sent on its own (larger than a bucket), and the
    largest of those sent on their own (0: none)."""
    def aligned(n: int) -> int:
        return -(-n // CHANNEL_ALIGN) * CHANNEL_ALIGN

    payloads: list[int] = []
    bucketed, used, alone = False, 0, 0
    for _, s in shape.tensors():
        n = numel(s) * dtype_bytes
        if aligned(n) > bucket_bytes:
            payloads += [used] if used else []
            payloads.append(n)
            used, alone = 0, max(alone, n)
            continue
        if used + n > bucket_bytes:
            payloads.append(used)
            used = 0
        bucketed = True
        used = min(aligned(used + n), bucket_bytes)
    payloads += [used] if used else []
    return bucketed, payloads, alone


def layer_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """One decoder layer's full (unsharded) weights: what FSDP2 all-gathers per unit."""
    return shape.layer_params * dtype_bytes


def root_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """The root FSDP unit's full weights (embeddings, final norm, untied lm_head, vision tower):
    the root is not resharded after forward, so these stay gathered through backward."""
    return (shape.num_params - shape.decoder_params) * dtype_bytes
