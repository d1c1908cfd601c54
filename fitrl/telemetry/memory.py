"""Memory readings of this process (host RSS, peak RSS, GPU allocated/reserved/peak)."""

from __future__ import annotations

import resource
import sys

import psutil
import torch

GIB = 1024**3


def host_memory() -> dict[str, float]:
    """Current RSS, peak RSS of this process and node available memory, in GiB."""
    rss = psutil.Process().memory_info().rss
    # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {
        "mem/host_rss_gib": rss / GIB,
        "mem/host_peak_rss_gib": peak / GIB,
        "mem/node_available_gib": psutil.virtual_memory().available / GIB,
    }


def gpu_memory() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    return {
        "mem/gpu_allocated_gib": torch.cuda.memory_allocated() / GIB,
        "mem/gpu_reserved_gib": torch.cuda.memory_reserved() / GIB,
        "mem/gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB,
    }
