"""Memory readings of this process and its node: host RSS/USS/peak, node available, GPU.

Readings are cheap enough to take at every phase boundary (a few /proc reads; USS walks
``/proc/self/smaps_rollup``, about a millisecond). The peak RSS *within* a phase comes from the
kernel's high-water mark (``VmHWM``), which :func:`reset_peak_rss` rewinds to the current RSS
at the start of the phase (Linux ``/proc/self/clear_refs``); where that is not allowed the
peak is the process-lifetime one and :func:`reset_peak_rss` says so by returning False.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import psutil
import torch

GIB = 1024**3
MIB = 1024**2


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (Linux), e.g. ``VmHWM``, ``VmRSS``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Rewind this process's RSS high-water mark to its current RSS (writing 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """RSS high-water mark since the last :func:`reset_peak_rss` (else since the process began)."""
    try:
        return status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        # ru_maxrss is KiB on Linux, bytes on macOS; it cannot be reset
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def trim_heap() -> bool:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``), so RSS shows what is held;
    False where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def node_available_bytes() -> int:
    """Memory the node can still give without swapping (``MemAvailable``), the number the OS
    and Ray's memory monitor act on. Tests replace this function to simulate a filling node."""
    return psutil.virtual_memory().available


def node_total_bytes() -> int:
    return psutil.virtual_memory().total


@dataclass
class MemoryReading:
    """One snapshot, in bytes. GPU fields are 0 without CUDA."""

    host_rss: int
    host_uss: int  # pages only this process holds: what killing it would free
    node_available: int
    node_total: int
    gpu_allocated: int = 0
    gpu_reserved: int = 0
    gpu_total: int = 0


def read_memory(uss: bool = True) -> MemoryReading:
    proc = psutil.Process()
    rss = proc.memory_info().rss
    unique = 0
    if uss:
        try:
            unique = proc.memory_full_info().uss
        except (psutil.AccessDenied, OSError):
            unique = 0
    vm = psutil.virtual_memory()
    available = node_available_bytes()
    reading = MemoryReading(host_rss=rss, host_uss=unique, node_available=available, node_total=vm.total)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        reading.gpu_allocated = torch.cuda.memory_allocated()
        reading.gpu_reserved = torch.cuda.memory_reserved()
        reading.gpu_total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return reading


def gpu_used_fraction() -> float:
    """Fraction of the current device in use by every process on it (0 without CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return 1.0 - free / total


def host_memory() -> dict[str, float]:
    """Current RSS, peak RSS of this process and node available memory, in GiB."""
    return {
        "mem/host_rss_gib": psutil.Process().memory_info().rss / GIB,
        "mem/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * (1 if sys.platform == "darwin" else 1024) / GIB,
        "mem/node_available_gib": node_available_bytes() / GIB,
    }

