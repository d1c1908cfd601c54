"""Parallelism's ground floor: process groups, collectives and FSDP2 sharding.

Imports only torch, the standard library and :mod:`fitrl.core` (see docs/architecture.md,
"Layers"): nothing here knows about configs, model families or roles. Callers pass plain
arguments (or duck-typed settings, see :class:`fitrl.distributed.fsdp.ShardSettings`).

- :mod:`~fitrl.distributed.process_group`  where a rank sits and how it joins its group (no torch at import)
- :mod:`~fitrl.distributed.collectives`    ``distributed()`` and all-reduces of Python numbers
- :mod:`~fitrl.distributed.sharding`       the sharding backends' seam: registry, and what a sharded model is asked
- :mod:`~fitrl.distributed.fsdp`           FSDP2's primitives (its backend: fitrl/sharding/fsdp2/)
- :mod:`~fitrl.distributed.state`          a model's full state dict from its shards, at once or streamed
- :mod:`~fitrl.distributed.host_device`    model and optimizer tensors moved between host and device

This ``__init__`` imports nothing, so ``fitrl.distributed.process_group`` stays torch-free.
"""
