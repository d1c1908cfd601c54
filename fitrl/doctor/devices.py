"""Rungs ``devices`` and ``attention``: what this node's processes see, and which attention
kernels run on it."""

from __future__ import annotations

import os

import torch

from fitrl.doctor.child import RankContext
from fitrl.doctor.ladder import Failure, Passed

GIB = 1024**3


def devices(ctx: RankContext) -> Passed:
    """CPU: cores, memory, torch. CUDA: every visible device's name, capability and memory, the
    driver's and the build's CUDA versions, NCCL's; and a matmul on each device checked against
    the host's (a device that is listed but cannot compute fails here, not in a collective)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    host = {"cores": cores, "ram_gib": round(ram, 1), "torch": torch.__version__, "cuda_build": torch.version.cuda}
    if ctx.device_type == "cpu":
        # (the parent hides the GPUs from CPU ranks: it says why it chose the CPU)
        why = ctx.options.get("cpu_because") or "--device cpu"
        return Passed(f"CPU: {cores} cores, {ram:.1f} GiB RAM, torch {torch.__version__} (CUDA not used: {why})",
                      {"host": host})
    count = torch.cuda.device_count()
    if count == 0:
        raise Failure(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
                      "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    want = a @ a
    listed = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        x = a.to(f"cuda:{i}")
        got = (x @ x).cpu()
        err = float((got - want).abs().max() / want.abs().max())
        if not err < 1e-2:  # TF32 rounding is ~1e-3; NaN or a wrong result is a broken device
            raise Failure(f"cuda:{i} ({p.name}) computes a 512x512 fp32 matmul wrong (relative error {err:.2g})",
                          "check `nvidia-smi -q` for ECC errors and retired pages on that device")
        free, total = torch.cuda.mem_get_info(i)
        listed.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                       "memory_gib": round(total / GIB, 1), "free_gib": round(free / GIB, 1),
                       "bf16": torch.cuda.is_bf16_supported()})
    driver = _driver_version()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "none"
    names = sorted({d["name"] for d in listed})
    low = [d for d in listed if d["free_gib"] < 0.5 * d["memory_gib"]]
    busy = f"; cuda:{low[0]['index']} has only {low[0]['free_gib']} GiB free: another process holds it" if low else ""
    return Passed(f"{count} x {', '.join(names)} ({listed[0]['memory_gib']} GiB, sm {listed[0]['capability']}); "
                  f"driver {driver}, CUDA build {torch.version.cuda}, NCCL {nccl}, torch {torch.__version__}{busy}",
                  {"host": host, "devices": listed, "driver": driver, "nccl": nccl})


def _driver_version() -> str:
    """The driver's CUDA version (what ``nvidia-smi`` calls "CUDA Version"), e.g. ``12.4``."""
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is None:
        return "unknown"
    v = int(get())
    return f"{v // 1000}.{v % 1000 // 10}"


def attention(ctx: RankContext) -> Passed:
    """Each SDPA backend tried alone on a causal bf16 (CUDA) or fp32 (CPU) call against the math
    kernel; flash-attn importable or not; PyTorch's varlen kernel (CUDA) on two packed sequences."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=g).to(dev, dtype) for _ in range(3))  # (B, H, T, D)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = sdpa(q.float(), k.float(), v.float(), is_causal=True)
    names = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    runs, why = [], {}
    for name in names:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue
        try:
            with sdpa_kernel([backend]):
                out = sdpa(q, k, v, is_causal=True)
        except RuntimeError as e:
            why[name.lower()] = str(e).strip().splitlines()[0][:160]
            continue
        err = float((out.float() - ref).abs().max())
        if not err < (5e-2 if dtype == torch.bfloat16 else 1e-4):
            raise Failure(f"SDPA's {name.lower()} kernel disagrees with the math kernel by {err:.3g} on {dev}",
                          "a kernel bug in this torch build on this GPU: report it with the torch version; "
                          "meanwhile actor.model.attn_implementation=eager avoids it")
        runs.append(name.lower())
    flash = _flash_attn()
    varlen = _varlen(dev, dtype)
    packed = _packed_kernel(dev, varlen)
    fused = [n for n in runs if n != "math"]
    if dev.type == "cuda" and not fused:
        raise Failure(f"only SDPA's math kernel runs on {dev} ({'; '.join(f'{k}: {v}' for k, v in why.items())})",
                      "attention will be several times slower and hold the full score matrix: check that this "
                      "torch build supports the GPU's architecture")
    data = {"sdpa_backends": runs, "sdpa_unavailable": why, "flash_attn": flash, "varlen": varlen,
            "packed_sequences": packed}
    return Passed(f"SDPA {str(dtype).removeprefix('torch.')} on {dev.type}: {', '.join(runs)} run; flash-attn {flash}; "
                  f"varlen {varlen}; packed sequences: {packed}", data)


def _flash_attn() -> str:
    try:
        import flash_attn
    except Exception as e:  # absent, or built for another torch: its import error says which
        return f"not importable ({type(e).__name__})"
    return f"{flash_attn.__version__}"


def _varlen(dev: torch.device, dtype: torch.dtype) -> str:
    """PyTorch's own varlen attention on two packed sequences (CUDA only in torch 2.13)."""
    if dev.type != "cuda":
        return "CUDA only"
    from fitrl.ops.varlen import torch_varlen_kernel

    varlen_attn = torch_varlen_kernel()  # the kernel packed forwards would run
    if varlen_attn is None:
        return "not in this torch"
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(96, 4, 64, generator=g).to(dev, dtype) for _ in range(3))  # (tokens, H, D)
    cu = torch.tensor([0, 32, 96], device=dev, dtype=torch.int32)
    try:
        varlen_attn(q, k, v, cu, cu, 64, 64, window_size=(-1, 0))  # causal
    except Exception as e:
        return f"does not run ({type(e).__name__}: {str(e).strip().splitlines()[0][:120]})"
    return "runs"


def _packed_kernel(dev: torch.device, varlen: str) -> str:
    """What fitrl's packed forwards run with the default ``attn_implementation`` on ``dev``: the
    choice of fitrl/ops/varlen.py (``packed_kernel``), and the dense mask where the kernel this
    rung tried does not run."""
    from transformers import PretrainedConfig

    from fitrl.config.roles import ModelConfig
    from fitrl.ops.varlen import packed_kernel

    config = PretrainedConfig()
    config._attn_implementation = ModelConfig().attn_implementation
    chosen, line = packed_kernel(config, dev)
    text = line.removeprefix("attention for packed sequences: ")
    if chosen is not None and varlen != "runs":
        raise Failure(f"packed sequences would run torch's varlen_attn on {dev}, which {varlen}",
                      "a kernel gap in this torch build on this GPU: actor.packing=false avoids it")
    return text