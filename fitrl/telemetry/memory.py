"""Memory readings of this process and its node: host RSS/USS/peak, node available, GPU.

Two costs. RSS (``/proc/self/statm``), the peak (``/proc/self/status``) and the node's
available memory (``/proc/meminfo``) are counters the kernel keeps: a reading is ~40 us
whatever the process's size, cheap enough for every phase boundary. USS is not: the kernel
walks the process's page tables to produce ``/proc/self/smaps_rollup``, and the walk grows with
what is mapped (3 ms at 0.3 GiB RSS, 38 ms at 2.8 GiB, on the 2-core CI machine), so
:func:`read_memory` takes it only when asked (``uss=True``), and the phase recorder asks rarely
(:class:`fitrl.telemetry.phases.PhaseRecorder`).

The peak RSS *within* a phase has two sources (:class:`fitrl.telemetry.phases.PhaseRecorder`
chooses, ``memory.phase_peaks``). By default the kernel's high-water mark (``VmHWM``) is left
alone, so what ``/usr/bin/time -v`` and ``ru_maxrss`` report stays the process's lifetime peak: a
phase that raises that mark reads its peak exactly from it, and any other phase's peak is the
largest RSS a sampling process saw (:mod:`fitrl.telemetry.peak_sampler`; a lower bound, short
of the truth only by a spike briefer than its interval). With ``rewind``, :func:`reset_peak_rss`
rewinds the mark to the current RSS at each phase's start (Linux ``/proc/self/clear_refs``),
exact for every phase, at the cost of the kernel's lifetime figure (kept here,
:func:`lifetime_peak_rss_bytes`); where that is not allowed the peak is the process-lifetime one
and :func:`reset_peak_rss` says so by returning False.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from dataclasses import dataclass

import psutil
import torch

from fitrl.core.device import cuda_in_use

GIB = 1024**3
MIB = 1024**2


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (Linux), e.g. ``VmHWM``, ``VmRSS``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


_LIFETIME_PEAK = [0]  # bytes: the largest high-water mark seen before a rewind


def reset_peak_rss() -> bool:
    """Rewind this process's RSS high-water mark to its current RSS (writing 5 to clear_refs), so a
    phase reads its own peak. The kernel's lifetime peak (``VmHWM``, ``ru_maxrss``, what
    ``/usr/bin/time -v`` reports) is rewound with it: the mark reached so far is kept here first
    (:func:`lifetime_peak_rss_bytes`)."""
    _LIFETIME_PEAK[0] = max(_LIFETIME_PEAK[0], peak_rss_bytes())
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


def lifetime_peak_rss_bytes() -> int:
    """This process's peak RSS since it began, the phases' rewinds (:func:`reset_peak_rss`) notwithstanding."""
    return max(_LIFETIME_PEAK[0], peak_rss_bytes(),
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024))


@functools.lru_cache(maxsize=None)
def _libc():
    """glibc, or None (another C library, another OS)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (raises AttributeError where there is no glibc)
        return libc
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Give freed heap pages back to the OS (glibc ``malloc_trim(0)``: every arena's free pages,
    not only the heap's top), so RSS shows what is held; False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.lru_cache(maxsize=None)
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set, from ``/proc/self/statm`` (one kernel counter; psutil where
    there is no procfs)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return psutil.Process().memory_info().rss


def uss_bytes() -> int:
    """Pages only this process holds (what killing it would free): a walk of its page tables,
    ~14 ms per GiB of RSS. 0 where the OS does not say."""
    try:
        return psutil.Process().memory_full_info().uss
    except (psutil.AccessDenied, OSError):
        return 0


def _meminfo_kib(field: str) -> int:
    with open("/proc/meminfo", "rb") as f:
        key = field.encode() + b":"
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(field)


def node_available_bytes() -> int:
    """Memory the node can still give without swapping (``MemAvailable``), the number the OS
    and Ray's memory monitor act on. Tests replace this function to simulate a filling node."""
    try:
        return _meminfo_kib("MemAvailable") * 1024
    except (OSError, KeyError, ValueError):
        return psutil.virtual_memory().available


@functools.lru_cache(maxsize=None)
def node_total_bytes() -> int:
    """The node's RAM (``MemTotal``); read once, it does not change while a process runs."""
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
    gpu_device_used: int = 0  # the whole device, every process and the CUDA context included


def read_memory(uss: bool = False) -> MemoryReading:
    """A snapshot; ``uss=True`` adds the page-table walk (:func:`uss_bytes`), else ``host_uss`` is 0."""
    reading = MemoryReading(host_rss=rss_bytes(), host_uss=uss_bytes() if uss else 0,
                            node_available=node_available_bytes(), node_total=node_total_bytes())
    if cuda_in_use():  # (a Ray driver: mem_get_info would make a context on GPU 0 to read the ranks' use)
        reading.gpu_allocated = torch.cuda.memory_allocated()
        reading.gpu_reserved = torch.cuda.memory_reserved()
        free, reading.gpu_total = torch.cuda.mem_get_info()
        reading.gpu_device_used = reading.gpu_total - free
    return reading


def gpu_used_fraction() -> float:
    """Fraction of the current device in use by every process on it (0 without CUDA)."""
    if not cuda_in_use():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return 1.0 - free / total


def host_memory() -> dict[str, float]:
    """Current RSS, peak RSS of this process and node available memory, in GiB."""
    return {
        "mem/host_rss_gib": rss_bytes() / GIB,
        "mem/host_peak_rss_gib": lifetime_peak_rss_bytes() / GIB,
        "mem/node_available_gib": node_available_bytes() / GIB,
    }

