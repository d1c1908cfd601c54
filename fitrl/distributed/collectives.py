"""Collectives on Python numbers, identities without a process group.

Losses use global token and sequence counts, and ranks must agree on loop lengths (micro-batch
counts, memory-guard verdicts): these are the one-number all-reduces for that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    """Is there a ``torch.distributed`` process group in this process?"""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in its group (0 without a process group)."""
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    """Ranks in this process's group (1 without a process group)."""
    return dist.get_world_size() if distributed() else 1


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Sum a Python number over all ranks (identity without a process group)."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_max_float(value: float, device: torch.device) -> float:
    """The largest of a Python float over all ranks (identity without a process group)."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of a Python int over all ranks (identity without a process group); counts
    and lengths, exact in float64 below 2**53."""
    return int(all_reduce_max_float(value, device)) if distributed() else value


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True where ``flag`` is true on every rank (``flag`` itself without a process group)."""
    if not distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
