"""``trainer.device`` to a torch device, the same answer for the planner, the driver and every rank."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from fitrl.core.bf16_matmul import bf16_matmuls
from fitrl.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when this process sees it, else CPU. ``cuda`` without CUDA is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    return torch.device(name)


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """``dtype`` compute on fp32 weights (``torch.autocast``), nothing when ``dtype`` is None.
    Autocast caches each weight's low-precision copy until the context exits: a context must
    never span an optimizer step (it would compute with the weights from before it). bf16 on a
    CPU without bf16 GEMM kernels also runs its products through fitrl/core/bf16_matmul.py."""
    if dtype is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=dtype))
    stack.enter_context(bf16_matmuls(device, dtype))
    return stack


def low_precision_backward(device: torch.device, dtype: Optional[torch.dtype]):
    """What a backward of a forward run under ``autocast(device, dtype)`` needs around it: the
    bf16 matmul kernels of fitrl/core/bf16_matmul.py on a CPU without its own, else nothing."""
    return bf16_matmuls(device, dtype)
