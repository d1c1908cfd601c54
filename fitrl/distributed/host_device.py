"""Moving a model's and an optimizer's tensors between host and device, and checking where they are.

Backend-neutral: a plain module, an FSDP2-sharded one or any other sharding's parameters move
with ``Module.to``; the optimizer's states follow them (fitrl/roles/offload.py keeps a role's
weights in host memory between its phases with these).
"""

from __future__ import annotations

import torch
from torch import nn


def move_model(m: nn.Module, device: torch.device | str) -> None:
    """Move parameters (sharded or not) and their gradients between host and device."""
    m.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move an optimizer's state tensors between host and device: the moments always; the
    ``step`` counters only where the kernel reads them on the parameter's device (a fused or
    capturable AdamW), else they stay on the host, where the default kernel reads them without
    a device sync."""
    for group in optimizer.param_groups:
        step_follows = _step_on_param_device(group)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and (k != "step" or step_follows):
                    state[k] = v.to(device, non_blocking=True)


def _step_on_param_device(group: dict) -> bool:
    """Does this param group's kernel read ``step`` on the parameter's device? (torch's
    note [special device hosting for step]: fused and capturable kernels do.)"""
    return bool(group.get("fused") or group.get("capturable"))


def optimizer_state_misplaced(optimizer: torch.optim.Optimizer) -> list[str]:
    """Every optimizer state tensor not where the next ``step()`` reads it, one line each
    (empty: all in place). Moments belong on their parameter's device; ``step`` there too for a
    fused or capturable kernel, on the host otherwise. A fused AdamW whose ``step`` stayed on the
    host while its parameters went to the GPU fails its first update (after a resume or a
    restart with offloading)."""
    wrong = []
    for g, group in enumerate(optimizer.param_groups):
        step_follows = _step_on_param_device(group)
        for i, p in enumerate(group["params"]):
            for k, v in optimizer.state.get(p, {}).items():
                if not isinstance(v, torch.Tensor):
                    continue
                needed = p.device if k != "step" or step_follows else torch.device("cpu")
                if v.device != needed:
                    wrong.append(f"param group {g} parameter {i} {tuple(p.shape)}: {k} on {v.device}, "
                                 f"its update reads it on {needed}")
    return wrong


def check_optimizer_on_param_devices(optimizer: torch.optim.Optimizer) -> None:
    """Raise when :func:`optimizer_state_misplaced` finds a state tensor out of place (a bug in
    fitrl's offloading, not a user's mistake), naming the first few."""
    wrong = optimizer_state_misplaced(optimizer)
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise RuntimeError(f"optimizer state on the wrong device before an update: {'; '.join(wrong[:3])}{more}")
