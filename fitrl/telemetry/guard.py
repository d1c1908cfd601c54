"""The memory guard: stop cleanly before the OS or Ray kills a process (docs/architecture.md, "Memory model").

Each process of a run has one :data:`GUARD`. Readings are taken at *safe points*: between the
micro-batches of read-only phases (generation, log-probs, reference, values), where leaving
the phase loses nothing but the phase's own work, and at the driver's phase boundaries. When
the node's available memory is under the threshold, or the GPU is nearly full, a safe point
raises :class:`MemoryPressure`. Under FSDP every forward is a collective, so ranks decide
together: each safe point all-reduces the local verdict, and every rank leaves at the same
micro-batch (no rank is left waiting in a collective). Generation runs from gathered weights
with no collective: there each rank decides alone, at each micro-batch and, through
:meth:`MemoryGuard.poll`, every ``POLL_INTERVAL_S`` of token steps (the KV cache grows per token).

Updates (actor, critic) have no safe points: stopping half-way through the optimizer steps
would leave weights and optimizer state out of step with each other. A threshold crossed
during an update is acted on when the step ends; the emergency checkpoint then holds that
complete step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from fitrl.core.device import cuda_in_use
from fitrl.distributed.collectives import all_reduce_max, world_size
from fitrl.telemetry import memory as mem
from fitrl.telemetry.memory import GIB
from fitrl.telemetry.phases import RECORDER

HOST, GPU = 1, 2  # verdict codes, all-reduced with max: GPU pressure outranks host pressure
POLL_INTERVAL_S = 0.25  # tight loops: a reading (~30 us of /proc) at most this often
CACHE_SAYS = 0.10  # a GPU stop names fragmentation when the cache is at least this share of the memory in use
USS_NEAR = 1.5  # node available under this x the host threshold: the recorder reads USS at the phase's end


class MemoryPressure(RuntimeError):
    """Memory ran low at a safe point. ``origin`` is True on the process whose reading tripped
    (the others left because it did); the driver reports the origin's numbers."""

    def __init__(self, kind: str, process: str, phase: Optional[str], available: int, threshold: int,
                 total: int, origin: bool = True, cache: int = 0):
        self.kind, self.process, self.phase = kind, process, phase
        self.available, self.threshold, self.total, self.origin = available, threshold, total, origin
        self.cache = cache  # GPU: what this process's caching allocator holds that no tensor uses
        where = f"during {phase!r}" if phase else "between phases"
        if kind == "gpu":
            text = (f"GPU memory of {process} nearly full {where}: {(total - available) / GIB:.1f} of "
                    f"{total / GIB:.1f} GiB in use (guard: {threshold / GIB:.1f} GiB must stay free)")
            if cache >= CACHE_SAYS * max(total - available, 1):  # fragmentation, not tensors: say what helps
                text += (f"; {cache / GIB:.1f} GiB of it is {process}'s allocator cache (reserved, no tensor in it): "
                         f"fragmentation, which memory.expandable_segments=on (PYTORCH_CUDA_ALLOC_CONF="
                         f"expandable_segments:True) avoids")
        else:
            text = (f"host memory low {where} ({process}): {available / GIB:.2f} GiB available on the node, "
                    f"under the guard's {threshold / GIB:.2f} GiB of {total / GIB:.1f} GiB")
        if not origin:
            text += " [reported by another rank]"
        super().__init__(text)

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields
        return (MemoryPressure, (self.kind, self.process, self.phase, self.available, self.threshold,
                                 self.total, self.origin, self.cache))


@dataclass
class GuardSettings:
    enabled: bool = False
    min_available_bytes: Optional[int] = None  # None: fraction of the node's RAM
    min_available_fraction: float = 0.07
    gpu_max_fraction: float = 0.97


class MemoryGuard:
    def __init__(self) -> None:
        self.settings = GuardSettings()
        self.process = "rank0"
        self.phase: Optional[str] = None
        self.deferred: Optional[MemoryPressure] = None  # crossed where no safe point could act
        self._last_poll = 0.0

    def configure(self, memory_cfg, process: Optional[str] = None) -> None:
        """From a ``MemoryConfig`` (``cfg.memory``); also sets this process's recorder."""
        RECORDER.configure(memory_cfg.telemetry, memory_cfg.uss_every, memory_cfg.uss_min_phase_s,
                           memory_cfg.phase_peaks)
        gib = memory_cfg.guard_min_available_gib
        self.settings = GuardSettings(
            enabled=memory_cfg.guard, min_available_bytes=None if gib is None else int(gib * GIB),
            min_available_fraction=memory_cfg.guard_min_available_fraction,
            gpu_max_fraction=memory_cfg.guard_gpu_max_fraction)
        if process is not None:
            self.process = process

    def host_threshold(self, total: int) -> int:
        s = self.settings
        return s.min_available_bytes if s.min_available_bytes is not None else int(s.min_available_fraction * total)

    def reading(self) -> Optional[MemoryPressure]:
        """This process's verdict now (None: memory is fine)."""
        if not self.settings.enabled:
            return None
        if cuda_in_use():  # (not in a Ray driver: device-wide use there is the ranks', which they guard)
            used = mem.gpu_used_fraction()
            if used > self.settings.gpu_max_fraction:
                free, total = torch.cuda.mem_get_info()
                cache = max(0, torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
                return MemoryPressure("gpu", self.process, self.phase, free, int((1 - self.settings.gpu_max_fraction)
                                                                                 * total), total, cache=cache)
        available, total = mem.node_available_bytes(), mem.node_total_bytes()  # module attributes: tests can simulate
        threshold = self.host_threshold(total)
        if available < USS_NEAR * threshold:  # near: record what this process alone would free
            RECORDER.want_uss()
        if available < threshold:
            return MemoryPressure("host", self.process, self.phase, available, threshold, total)
        return None

    def check(self, device: Optional[torch.device] = None, collective: bool = True) -> None:
        """A safe point: raise :class:`MemoryPressure` when memory is low here or, in a process
        group, on any rank (one small all-reduce, so every rank must reach the same safe points).
        ``collective=False`` where ranks run no collective and may reach different numbers of
        safe points (generation from gathered weights): a rank then leaves alone and the others
        finish the phase or meet the same low memory at their next safe point."""
        if not self.settings.enabled:
            return
        pressure = self.reading()
        if collective and world_size() > 1:
            local = 0 if pressure is None else (GPU if pressure.kind == "gpu" else HOST)
            verdict = all_reduce_max(local, device or torch.device("cpu"))
            if verdict and pressure is None:
                raise MemoryPressure("gpu" if verdict == GPU else "host", self.process, self.phase, 0, 0, 0,
                                     origin=False)
        if pressure is not None:
            raise pressure

    def poll(self) -> None:
        """A local safe point for tight loops (each generated token): a reading at most every
        ``POLL_INTERVAL_S``, no collective."""
        if not self.settings.enabled:
            return
        now = time.monotonic()
        if now - self._last_poll < POLL_INTERVAL_S:
            return
        self._last_poll = now
        self.check(collective=False)

    def note(self) -> None:
        """Where no safe point can act (during an update): remember the first crossing."""
        if self.deferred is None:
            self.deferred = self.reading()

    def take_deferred(self) -> Optional[MemoryPressure]:
        out, self.deferred = self.deferred, None
        return out


GUARD = MemoryGuard()
"""This process's guard; configured by the trainer (driver) and by each worker (Ray ranks)."""
