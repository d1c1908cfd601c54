"""Peak memory of log-prob + entropy from last hidden states: naive full logits vs chunked.

Workload: an lm_head of vocabulary 152,064 (Qwen2.5-7B's) and hidden 896 (Qwen2.5-0.5B's;
the logits, hence the peak, do not depend on the hidden size, only the matmul time does),
fp32 weights, B=1 sequence of T tokens, temperature 1.
  naive:    logits = h W^T (T, V) -> fp32 log_softmax -> gather, entropy -(p * logp).sum
  chunk N:  fitrl.ops.logprob.head_logprobs(chunk_size=N): lm_head + logsumexp + gather +
            entropy per N tokens; backward recomputes each chunk's logits (only the (T, H)
            hidden states are saved) and forms dL/dlogits in place.
Phases: ``fwd`` under no_grad (old/ref log-probs); ``fwd+bwd`` with the log-probs and the
entropy in the loss (an entropy bonus: the larger graph), W.grad already allocated (model state).

Each run is a fresh subprocess. Peak = on CPU, the peak RSS (VmHWM, reset through
/proc/self/clear_refs once the inputs are allocated) minus the RSS at that point; on CUDA,
``max_memory_allocated`` minus the bytes allocated after the inputs. max|d| columns compare
log-probs, entropies and the gradients of hidden states and lm_head weight with naive at the same T.
Naive runs estimated not to fit in available memory are skipped rather than OOM-killed.

    .venv/bin/python bench/logprob_memory.py                       # T 4096 and 8192, chunks 1024 and 4096
    .venv/bin/python bench/logprob_memory.py --tokens 16384 --chunks 1024 --device cuda
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

from fitrl.ops.logprob import head_logprobs
from fitrl.telemetry.memory import peak_rss_bytes, reset_peak_rss, status_kib

GiB, MiB = 2**30, 2**20


def naive(hidden, labels, weight, temperature):
    logits = F.linear(hidden, weight).float()  # (1, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def run_one(spec: dict) -> dict:
    """Child process: allocate inputs, measure one computation, save its outputs for comparison."""
    torch.manual_seed(0)
    dev, T, V, H = torch.device(spec["device"]), spec["tokens"], spec["vocab"], spec["hidden"]
    dtype = getattr(torch, spec["dtype"])
    backward = spec["phase"] == "fwd+bwd"
    weight = (torch.randn(V, H, device=dev) * (2 / H**0.5)).to(dtype).requires_grad_(backward)
    hidden = torch.randn(1, T, H, device=dev).to(dtype).requires_grad_(backward)
    labels = torch.randint(0, V, (1, T), device=dev)
    if backward:
        weight.grad = torch.zeros_like(weight)  # gradient buffers are model state, not this computation
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        # Reset the high-water mark so that the peak starts here, not at the inputs' temporaries.
        # (VmHWM, not ``ru_maxrss``: that never reports less than the parent's RSS at fork, kept
        # across exec, which can exceed this child's peak.)
        if not reset_peak_rss():
            raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peak would be the lifetime one")
        base = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if spec["mode"] == "naive":
            logp, entropy = naive(hidden, labels, weight, spec["temperature"])
        else:
            logp, entropy = head_logprobs(hidden, labels, weight, temperature=spec["temperature"],
                                          chunk_size=spec["chunk"], with_entropy=True, entropy_grad=True)
        if backward:
            (-logp.sum() - 0.01 * entropy.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss_bytes() - base
    seconds = time.perf_counter() - t0
    out = {"logp": logp.detach().cpu(), "entropy": entropy.detach().cpu()}
    if backward:
        out["grad h"] = hidden.grad.float().cpu()
        out["grad W"] = weight.grad.float().cpu()
    torch.save(out, spec["save"])
    return {"peak": peak, "seconds": seconds}


def fits(spec: dict) -> tuple[bool, float]:
    """Naive's estimated peak (4.1 fp32 T x V copies forward, 5.1 with backward, as measured) vs free memory."""
    est = (4.1 if spec["phase"] == "fwd" else 5.1) * spec["tokens"] * spec["vocab"] * 4
    if spec["device"] == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return est < 0.8 * free - 2 * spec["vocab"] * spec["hidden"] * 4, est


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152_064)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--phases", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return

    print(f"vocab {args.vocab:,}, hidden {args.hidden}, {args.dtype} weights, B=1, temperature {args.temperature}, "
          f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"peak = {'max_memory_allocated' if args.device == 'cuda' else 'peak RSS'} above the inputs")
    print(f"{'T':>6} {'phase':>8} {'mode':>10} {'peak MiB':>9} {'x lower':>8} {'max|d logp|':>12} "
          f"{'max|d ent|':>11} {'max|d grad h|':>14} {'max|d grad W|':>14} {'s':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for T in args.tokens:
            for phase in args.phases:
                ref = None
                for mode in ["naive"] + [f"chunk {c}" for c in args.chunks]:
                    spec = dict(device=args.device, tokens=T, vocab=args.vocab, hidden=args.hidden, dtype=args.dtype,
                                phase=phase, mode=mode, chunk=int(mode.split()[-1]) if mode != "naive" else 0,
                                temperature=args.temperature, save=f"{tmp}/{T}-{phase}-{mode}.pt")
                    ok, est = fits(spec) if mode == "naive" else (True, 0)
                    if not ok:
                        print(f"{T:>6} {phase:>8} {mode:>10}   skipped: needs ~{est / GiB:.0f} GiB, more than is free")
                        continue
                    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                          capture_output=True, text=True)
                    if proc.returncode != 0:
                        print(f"{T:>6} {phase:>8} {mode:>10}   failed (rc {proc.returncode}): "
                              f"{proc.stderr.strip().splitlines()[-1:]}")
                        continue
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    out = torch.load(spec["save"])
                    if mode == "naive":
                        ref = (res, out)
                    lower = f"{ref[0]['peak'] / res['peak']:.1f}" if ref else "-"
                    diffs = [f"{(out[k] - ref[1][k]).abs().max().item():.1e}" if ref else "-"
                             for k in ("logp", "entropy", "grad h", "grad W") if k in out] + ["", ""]
                    print(f"{T:>6} {phase:>8} {mode:>10} {res['peak'] / MiB:>9,.0f} {lower:>8} {diffs[0]:>12} "
                          f"{diffs[1]:>11} {diffs[2]:>14} {diffs[3]:>14} {res['seconds']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
