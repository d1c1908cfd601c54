"""bf16 matrix products on CPUs that have no bf16 matmul kernel.

PyTorch's CPU bf16 GEMM is fast only through oneDNN, which needs AVX-512 (or AMX). On an AVX2
machine ``torch.mm`` in bf16 falls back to a scalar loop: 0.6-3 GFLOP/s against 50-90 GFLOP/s
for the same product in fp32 on one core of this project's CI machine (bench/RESULTS.md, "bf16 on
a CPU without bf16 kernels"), so a bf16 autocast step there is matmul time and little else.

``Bf16MatmulsInFp32`` reroutes the four matmul ops that a transformer's forward and backward
reach (``mm``, ``addmm``, ``bmm``, ``baddbmm``) when their operands are bf16 CPU tensors: the
operands are widened to fp32 (exactly: every bf16 value is an fp32 value), multiplied and summed
by the fp32 kernel, and the result is rounded once to bf16. That is the arithmetic of a bf16 GEMM
with fp32 accumulation, which is what the native kernel and cuBLAS compute; only the summation
order differs. Inputs, outputs, saved activations and the autocast weight copy stay bf16, so the
memory of the step is that of bf16 compute plus, for one product at a time, the fp32 copies of
its operands and result.

It is a dispatch mode (below autograd): it must be active where the products run, the forward
and the backward alike (``fitrl.core.device.autocast`` and ``low_precision_backward``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU runs bf16 GEMMs in oneDNN (AVX-512 or AMX); False on AVX2-only machines."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _is_bf16_cpu(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.device.type == "cpu"


class Bf16MatmulsInFp32(TorchDispatchMode):
    """bf16 CPU matmuls computed by the fp32 kernel on the same (widened) operands, rounded once."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and _is_bf16_cpu(args[0]):
            wide = [a.float() if _is_bf16_cpu(a) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_matmuls(device: torch.device, dtype: torch.dtype | None):
    """``Bf16MatmulsInFp32`` for bf16 compute on a CPU without bf16 kernels, else nothing."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16_matmul():
        return Bf16MatmulsInFp32()
    return contextlib.nullcontext()
