"""A model's whole state dict from its shards: gathered at once on the host (a checkpoint's
``hf/`` copy) or streamed one tensor at a time (a weight push to an engine).

Backend-neutral: it asks torch's distributed state-dict API (``get_model_state_dict``), which
knows every sharding torch builds on DTensor, and ``DTensor.full_tensor``; a plain module's
state is read as it is.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fitrl.distributed.collectives import distributed


def full_state_dict(m: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the host (rank 0 gets it; collective on every rank)."""
    if not distributed():
        return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def stream_full_tensors(m: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every entry of ``m``'s state dict, one at a time, on the
    parameters' device (cast to ``dtype`` if given).

    Under FSDP2 each entry is all-gathered from the shards as it is reached (a collective: every
    rank must drain the iterator in the same order) and dropped by the consumer before the next
    one, so a weight push holds at most one full tensor beyond the shards, never a second copy
    of the model. Tied weights (an output head sharing the embedding) come once per name, as in
    the state dict."""
    for name, value in m.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        yield name, (full.detach().to(dtype) if dtype is not None else full.detach())
