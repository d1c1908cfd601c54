"""Parallelism's ground floor: process groups, collectives and FSDP2 sharding.

Imports only torch, the standard library and :mod:`fitrl.core` (see docs/architecture.md,
"Layers"): nothing here knows about configs, model families or roles. Callers pass plain
arguments (or duck-typed settings, see :class:`fitrl.distributed.fsdp.ShardSettings`).

- :mod:`~fitrl.distributed.process_group`  where a rank sits and how it joins its group (no torch at import)
- :mod:`~fitrl.distributed.collectives`    ``distributed()`` and all-reduces of Python numbers
- :mod:`~fitrl.distributed.fsdp`           FSDP2 sharding, rank-0 weight broadcast, gathering and moving

This ``__init__`` imports nothing, so ``fitrl.distributed.process_group`` stays torch-free.
"""
