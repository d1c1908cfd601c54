"""bf16 products on a CPU without bf16 GEMM kernels (fitrl/core/bf16_matmul.py): the fp32 kernel
on the widened bf16 operands, rounded once, in the forward and the backward."""

import contextlib

import pytest
import torch

from fitrl.core import bf16_matmul
from fitrl.core.bf16_matmul import Bf16MatmulsInFp32, bf16_matmuls, cpu_has_bf16_matmul
from fitrl.core.device import autocast, low_precision_backward

CPU = torch.device("cpu")


def _operands(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g).bfloat16() for s in shapes]


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_each_product_is_the_fp32_product_of_the_bf16_operands_rounded_once(op):
    a, b, a3, b3, c, c3 = _operands((5, 7), (7, 3), (2, 5, 7), (2, 7, 3), (5, 3), (2, 5, 3))
    calls = {"mm": (torch.mm, (a, b)), "addmm": (torch.addmm, (c, a, b)),
             "bmm": (torch.bmm, (a3, b3)), "baddbmm": (torch.baddbmm, (c3, a3, b3))}
    fn, args = calls[op]
    with Bf16MatmulsInFp32():
        out = fn(*args)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fn(*[x.float() for x in args]).bfloat16())
    torch.testing.assert_close(out, fn(*args), rtol=1e-2, atol=1e-2)  # the native bf16 kernel's


def test_other_dtypes_and_ops_pass_through_untouched():
    a, b = torch.randn(4, 6), torch.randn(6, 2)
    x = torch.randn(8).bfloat16()
    with Bf16MatmulsInFp32():
        assert torch.equal(a @ b, torch.mm(a, b)) and (a @ b).dtype == torch.float32
        assert torch.equal(torch.exp(x), torch.exp(x.clone()))


def test_a_linear_layer_under_autocast_matches_bf16_compute_in_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(16, 12)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    grads = {}
    for name, mode in (("native", contextlib.nullcontext), ("wide", Bf16MatmulsInFp32)):
        layer.zero_grad(); x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), mode():
            y = layer(x)
        assert y.dtype == torch.bfloat16
        with mode():
            (y.float() ** 2).sum().backward()
        grads[name] = (y.detach(), layer.weight.grad.clone(), x.grad.clone())
    for native, wide in zip(grads["native"], grads["wide"]):
        torch.testing.assert_close(wide, native, rtol=2e-2, atol=2e-2)
    assert layer.weight.grad.dtype == torch.float32  # fp32 master weight


def test_the_backward_runs_its_products_through_the_mode_when_it_is_entered(monkeypatch):
    seen = []

    class Counting(Bf16MatmulsInFp32):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in bf16_matmul._MATMULS:
                seen.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setattr(bf16_matmul, "Bf16MatmulsInFp32", Counting)
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: False)
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4)
    with autocast(CPU, torch.bfloat16):
        y = torch.nn.functional.linear(x, w).float().sum()
    forward = len(seen)
    with low_precision_backward(CPU, torch.bfloat16):
        y.backward()
    assert forward == 1 and len(seen) == 2  # the weight's gradient product (x needs none)
    with low_precision_backward(CPU, None):
        pass
    assert len(seen) == 2


def test_only_bf16_on_a_cpu_without_kernels_gets_the_mode(monkeypatch):
    assert isinstance(bf16_matmuls(CPU, torch.float16), contextlib.nullcontext)
    assert isinstance(bf16_matmuls(CPU, None), contextlib.nullcontext)
    assert isinstance(bf16_matmuls(torch.device("meta"), torch.bfloat16), contextlib.nullcontext)
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: True)
    assert isinstance(bf16_matmuls(CPU, torch.bfloat16), contextlib.nullcontext)
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: False)
    assert isinstance(bf16_matmuls(CPU, torch.bfloat16), Bf16MatmulsInFp32)
    assert isinstance(cpu_has_bf16_matmul.__wrapped__(), bool)


def test_the_cpu_peak_for_mfu_measures_bf16_as_fitrl_runs_it(monkeypatch, tmp_path):
    from fitrl.telemetry import perf

    seen = []

    class Counting(Bf16MatmulsInFp32):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in bf16_matmul._MATMULS:
                seen.append(args[0].dtype)
            return super().__torch_dispatch__(func, types, args, kwargs)

    monkeypatch.setattr(bf16_matmul, "Bf16MatmulsInFp32", Counting)
    monkeypatch.setattr(bf16_matmul, "cpu_has_bf16_matmul", lambda: False)
    assert perf.measure_matmul_flops("bfloat16", 1, budget_s=1e-9) > 0
    assert len(seen) >= 2 and set(seen) == {torch.bfloat16}  # every product went through the mode
    seen.clear()
    perf.measure_matmul_flops("float32", 1, budget_s=1e-9)
    assert seen == []
    # a peak cached before the widening is not read back for it: the key says which kernel
    monkeypatch.setattr(perf, "cpu_has_bf16_matmul", lambda: False)
    keys = []
    perf.cpu_peak_flops(1, "bfloat16", path=tmp_path / "p.json", measure=lambda d, t: keys.append(d) or 1e9)
    assert "in the fp32 kernel" in (tmp_path / "p.json").read_text()
