"""Keeping a role's weights in host memory between its phases, and giving back what a phase freed."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from fitrl.config.schema import FSDPConfig
from fitrl.distributed.host_device import check_optimizer_on_param_devices, move_model, move_optimizer_state
from fitrl.telemetry.memory import trim_heap

DEBUG_ENV = "FITRL_DEBUG"
"""Set (not ``0``) in the ranks' environment, each update first checks that every optimizer
state sits where the update reads it (``check_optimizer_on_param_devices``): ``FITRL_DEBUG=1
fitrl train ...`` (the CLI's ``--debug`` flag alone only reaches the driver)."""


def debug_checks() -> bool:
    """Are this process's debug invariants on (``FITRL_DEBUG``, as the CLI reads it)?"""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


class OffloadBetweenPhases:
    """Keeps a role's parameters (and optimizer states) in host memory between its phases when
    ``fsdp.offload_params`` / ``offload_optimizer`` ask for it (a no-op on a CPU device), and gives
    what a phase freed back at its end: CUDA's cached blocks, or on a CPU device with ``trim``
    (``memory.trim_heap``) the heap's free pages (glibc ``malloc_trim``), which glibc would
    otherwise keep resident into the next step (bench/RESULTS.md, "Host memory on CPU")."""

    def __init__(self, model: torch.nn.Module, fsdp: FSDPConfig, device: torch.device,
                 optimizer: torch.optim.Optimizer | None = None, trim: bool = False):
        # any device other than the host moves: a test emulates the GPU on a CPU-only machine
        # with ``device=meta`` (tests/test_gpu_path_offload.py)
        self.model, self.fsdp, self.device, self.optimizer = model, fsdp, device, optimizer
        self.host = torch.device("cpu")
        self.active = device.type != "cpu" and not fsdp.cpu_offload
        self.trim = trim and device.type == "cpu"
        self.release()

    @contextmanager
    def phase(self, needs_optimizer: bool = False):
        if self.active and self.fsdp.offload_params:
            move_model(self.model, self.device)
        if self.active and needs_optimizer and self.fsdp.offload_optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)
        if needs_optimizer and self.optimizer is not None and debug_checks():
            check_optimizer_on_param_devices(self.optimizer)
        try:
            yield
        finally:
            self.release()

    def restored(self) -> None:
        """After a checkpoint was loaded outside a phase: the optimizer's restored states were
        created next to the parameters as they were then (on the host when ``offload_params``
        keeps them there), so they go where they wait between phases: on the host with
        ``offload_optimizer``, else on the device, where the next update reads them. Without
        this, a resumed or restarted run's first update meets moments (and a fused AdamW's
        ``step``) on the host and parameters on the GPU."""
        if self.active and self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.host if self.fsdp.offload_optimizer else self.device)

    def release(self) -> None:
        if self.active and self.fsdp.offload_params:
            move_model(self.model, self.host)
        if self.active and self.fsdp.offload_optimizer and self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.host)
        if self.active and self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back for the next role's phase
        if self.trim:
            trim_heap()

    def micro_batch_done(self) -> None:
        """Between micro-batches of a phase: on a CPU device with ``trim``, the heap's free pages
        too. Without it glibc's heap grows over a phase's micro-batches by an amount that changes
        from run to run (an update's peak 1.1-1.9x its live tensors, bench/RESULTS.md, "Host memory
        on CPU"); trimmed, each micro-batch starts from what is held."""
        if self.trim:
            trim_heap()


def low_precision(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None
