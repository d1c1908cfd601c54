"""Device peak FLOP/s for MFU: a table for common GPUs, a short matmul benchmark on CPU (cached).

MFU = model FLOPs per second achieved / (peak FLOP/s of one device x devices). The table holds
vendors' datasheet figures for dense matrix math (without 2:4 structured sparsity, which
datasheets often quote at twice these), in TFLOP/s, for three compute types:

- ``half``: bf16/fp16 tensor cores with fp32 accumulation (what PyTorch uses);
- ``tf32``: fp32 tensors through tensor cores (``torch.get_float32_matmul_precision()`` is
  ``high`` or ``medium``, or ``torch.backends.cuda.matmul.allow_tf32``);
- ``fp32``: plain fp32 (PyTorch's default for fp32 matmuls).

A device the table does not know gets no MFU (throughput is still logged); ``trainer.peak_flops``
sets the peak of one device by hand and overrides the table and the benchmark.

On CPU the peak is measured: the best rate of a square matmul at the run's dtype and thread
count, a fraction of a second, cached in ``peak_flops.json`` of fitrl's cache directory (``fitrl.core.cache``) under the CPU model, thread count and dtype, so a machine is measured once.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from fitrl.core.bf16_matmul import bf16_matmuls, cpu_has_bf16_matmul
from fitrl.core.cache import cache_root
from fitrl.core.device import gpu_name

log = logging.getLogger("fitrl.telemetry")

# (pattern matched against torch.cuda.get_device_name(), half, tf32, fp32) in TFLOP/s, dense.
# More specific names first ("H100 PCIe" before "H100", "A100" before "A10").
GPU_PEAK_TFLOPS: list[tuple[str, float, Optional[float], float]] = [
    (r"\bB200\b", 2250.0, 1125.0, 75.0),
    (r"\bH100\b.*\bNVL\b", 835.0, 417.5, 60.0),
    (r"\bH100\b.*\bPCIe\b", 756.0, 378.0, 51.0),
    (r"\bH100\b", 989.0, 494.5, 67.0),            # SXM (HBM3)
    (r"\bH200\b.*\bNVL\b", 835.0, 417.5, 60.0),
    (r"\bH200\b", 989.0, 494.5, 67.0),
    (r"\bH800\b", 989.0, 494.5, 67.0),
    (r"\bH20\b", 148.0, 74.0, 44.0),
    (r"\bA100\b", 312.0, 156.0, 19.5),            # 40 and 80 GB, SXM and PCIe
    (r"\bA800\b", 312.0, 156.0, 19.5),
    (r"\bA10\b", 125.0, 62.5, 31.2),             # not the A10G (AWS): no datasheet; set trainer.peak_flops
    (r"\bL40S\b", 362.0, 183.0, 91.6),
    (r"\bL40\b", 181.0, 90.5, 90.5),
    (r"\bL4\b", 121.0, 60.0, 30.3),
    (r"\bA40\b", 149.7, 74.8, 37.4),
    (r"RTX A6000", 154.8, 77.4, 38.7),
    (r"RTX 4090", 165.2, 82.6, 82.6),
    (r"RTX 3090", 71.0, 35.6, 35.6),
    (r"V100.*PCIe", 112.0, None, 14.0),           # Volta: fp16 tensor cores only, no tf32, no bf16
    (r"V100", 125.0, None, 15.7),
    (r"MI300X", 1307.4, 653.7, 163.4),
]

HALF_DTYPES = ("bfloat16", "float16")


def gpu_peak_flops(device_name: str, dtype: str, tf32: bool = False) -> Optional[float]:
    """FLOP/s of one GPU named ``device_name`` computing in ``dtype``; None when unknown."""
    for pattern, half, tf32_peak, fp32 in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            if dtype in HALF_DTYPES:
                return half * 1e12
            return (tf32_peak if tf32 and tf32_peak else fp32) * 1e12
    return None


def tf32_enabled() -> bool:
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


# --------------------------------------------------------------------------------------- CPU


def measure_matmul_flops(dtype: str, threads: int, budget_s: float = 0.3) -> float:
    """Best FLOP/s of an n x n matmul at ``dtype`` on ``threads`` threads. n grows (256 ... 2048)
    until one product takes 10 ms, so a slow dtype (bf16 without AMX) stays within the budget;
    then products are repeated for ``budget_s`` and the fastest counts (2 n^3 FLOPs each). bf16
    products run as fitrl runs them (:mod:`fitrl.core.bf16_matmul`: in the fp32 kernel on a CPU
    without bf16 kernels)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        with bf16_matmuls(torch.device("cpu"), getattr(torch, dtype)):
            return _best_square_product(dtype, budget_s)
    finally:
        torch.set_num_threads(before)


def _best_square_product(dtype: str, budget_s: float) -> float:
    gen = torch.Generator().manual_seed(0)
    for n in (256, 512, 1024, 2048):
        a = torch.randn(n, n, generator=gen).to(getattr(torch, dtype))
        b = torch.randn(n, n, generator=gen).to(getattr(torch, dtype))
        torch.mm(a, b)  # warm-up: first-call dispatch and allocation
        start = time.perf_counter()
        torch.mm(a, b)
        if time.perf_counter() - start >= 0.01:
            break
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return 2 * n ** 3 / best


def cache_file() -> Path:
    return cache_root() / "peak_flops.json"


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cpu_peak_flops(threads: int, dtype: str, *, path: Optional[Path] = None,
                   measure: Callable[[str, int], float] = measure_matmul_flops) -> float:
    """FLOP/s of this CPU at ``threads`` threads and ``dtype``: from the cache, else measured
    once and written there (an unwritable cache only means measuring again next run)."""
    path = path or cache_file()
    widened = dtype == "bfloat16" and not cpu_has_bf16_matmul()  # (a bf16 entry measured before it was)
    key = f"{cpu_model_name()} | threads={threads} | {dtype}{' in the fp32 kernel' if widened else ''}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key) if isinstance(cache, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"])
    flops = measure(dtype, threads)
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: two runs starting together never read half a file
    except OSError as e:
        log.info("could not cache the CPU peak in %s: %s", path, e)
    return flops


# --------------------------------------------------------------------------------------- both


def device_peak_flops(device: torch.device, dtype: str, threads: Optional[int] = None) -> tuple[Optional[float], str]:
    """(peak FLOP/s of one device, where it came from); (None, why) when it is not known."""
    if device.type == "cuda":
        name = gpu_name(device)  # (a Ray driver: a cluster GPU's, read in another process)
        tf32 = dtype not in HALF_DTYPES and tf32_enabled()
        peak = gpu_peak_flops(name, dtype, tf32=tf32)
        kind = "bf16/fp16" if dtype in HALF_DTYPES else ("tf32" if tf32 else "fp32")
        if peak is None:
            return None, f"no peak FLOP/s known for GPU {name!r}; set trainer.peak_flops for perf/mfu"
        return peak, f"{name} {kind} datasheet peak"
    if device.type == "cpu":
        threads = threads or torch.get_num_threads()
        return cpu_peak_flops(threads, dtype), f"CPU matmul benchmark ({threads} threads, {dtype})"
    return None, f"no peak FLOP/s known for device {device.type}; set trainer.peak_flops for perf/mfu"


def mfu(flops: float, seconds: float, peak_flops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: ``flops / seconds`` over the peak of all ``devices``."""
    if seconds <= 0 or peak_flops <= 0 or devices <= 0:
        return 0.0
    return flops / seconds / (peak_flops * devices)
