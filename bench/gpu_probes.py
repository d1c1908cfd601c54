"""The two probes of ``make gpu-check`` (bench/gpu_check.py runs each in a process of its own):
the memory a bare CUDA context takes, and what pinned host blocks of odd sizes hold beyond their
bytes (the caching host allocator's rounding, and what it keeps after free). Without CUDA they run
their plumbing on unpinned tensors."""

from __future__ import annotations

import os
import subprocess

GIB = 1024**3

def context_figures(used_before: int | None, free: int, total: int, reserved: int, used_after_matmul: int) -> dict:
    """A bare CUDA context's bytes from the device's use before and after initialisation (the
    allocator's own reserved blocks subtracted), and what the first cuBLAS matmul adds (its
    workspace and kernels' modules). ``used_before`` None: no reading before (no nvidia-smi)."""
    used = total - free
    context = used - reserved - used_before if used_before is not None else None
    return {"context_gib": context / GIB if context is not None else None, "used_before_gib":
            used_before / GIB if used_before is not None else None, "used_after_init_gib": used / GIB,
            "first_matmul_gib": (used_after_matmul - used) / GIB, "device_total_gib": total / GIB}


def device_used_smi(index: int = 0) -> int | None:
    """The device's used memory as the driver reports it, read without a CUDA context here."""
    try:
        p = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return int(p.stdout.strip().splitlines()[0]) * 1024**2 if p.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def context_probe() -> dict:
    """In a fresh process: the memory a bare CUDA context takes (see :func:`context_figures`)."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: no context to measure"}
    before = device_used_smi(0)
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context exists once something ran
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    (torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")).sum().item()
    free2, _ = torch.cuda.mem_get_info()
    return {**context_figures(before, free, total, reserved, total - free2 + reserved - torch.cuda.memory_reserved()),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


# sizes just above a power of two (plus odd bytes): a cache rounding up per tensor shows as ~2x
PINNED_SIZES = tuple(2**k + 4097 * (k - 15) for k in range(16, 27))
PINNED_REPEAT = 2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pinned_figures(sizes: list[int], rss_before: int, rss_after: int, rss_freed: int,
                   reserved: int | None = None) -> dict:
    """The rounding per tensor of a host cache: RSS growth (and the allocator's own reserve,
    where it reports one) over the tensors' bytes; what stays resident after they are freed."""
    nbytes = sum(sizes)
    growth = rss_after - rss_before
    return {"tensors": len(sizes), "bytes_gib": nbytes / GIB, "rss_growth_gib": growth / GIB,
            "rss_factor": growth / nbytes, "rounding_per_tensor_mib": (growth - nbytes) / len(sizes) / 1024**2,
            "reserved_factor": reserved / nbytes if reserved else None,
            "kept_after_free_gib": (rss_freed - rss_before) / GIB}


def pinned_probe() -> dict:
    """In a fresh process: pin tensors of odd sizes (each touched, so its pages are resident),
    read the RSS growth, free them and read it again (the caching host allocator keeps its
    blocks for the process's life). Without CUDA: the same with ordinary tensors (plumbing)."""
    import torch

    pin = torch.cuda.is_available()
    sizes = [n for n in PINNED_SIZES for _ in range(PINNED_REPEAT)]
    before = rss_bytes()
    held = [torch.empty(n, dtype=torch.uint8, pin_memory=pin).fill_(1) for n in sizes]
    after = rss_bytes()
    stats = torch.cuda.host_memory_stats() if pin and hasattr(torch.cuda, "host_memory_stats") else {}
    reserved = stats.get("reserved_bytes.current") or stats.get("allocated_bytes.current")
    del held
    return {**pinned_figures(sizes, before, after, rss_bytes(), reserved), "pinned": pin,
            "host_memory_stats": {k: v for k, v in stats.items() if k.endswith(".current") or k.endswith(".peak")}}


PROBES = {"context": context_probe, "pinned": pinned_probe}
