"""Seconds per AdamW step on the ``small`` tiny model's parameter shapes (32.0M fp32), for torch's
three implementations: per-tensor loop (the CPU default), multi-tensor (foreach) and fused.

    .venv/bin/python bench/optimizer_step.py --threads 1

Best of ``--repeats`` steps after one warm-up step (which allocates the moments).
"""

from __future__ import annotations

import argparse
import time

import torch

from fitrl.models.tiny import SIZES

IMPLEMENTATIONS = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def small_shapes() -> list[tuple[int, ...]]:
    """The small qwen2's parameter shapes (untied embeddings and head, 8 layers)."""
    s = SIZES["small"]
    h, i, v, layers = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    layer = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    return [(v, h), (v, h), (h,)] + layer * layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in small_shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    print(f"{sum(p.numel() for p in params) / 1e6:.1f}M fp32 parameters, {args.threads} thread(s)")
    for name, kwargs in IMPLEMENTATIONS.items():
        opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
        opt.step()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        print(f"{name:8s} {min(times):.3f} s/step")


if __name__ == "__main__":
    main()
