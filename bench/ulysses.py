"""Per-rank activation peak of one long sequence with Ulysses sequence parallelism (``actor.ulysses_size``).

Workload: a tiny model made here (``--arch``/``--size``, default the 18M-parameter qwen2 "deep":
hidden 256, 12 layers, 4 attention and 2 key/value heads), fp32 on CPU; one sequence of T tokens
(a 64-token prompt, the rest response), ``Actor.update`` (forward and backward, the chunked
head, AdamW) with ``ulysses_size`` 1 (one process) and 2 (two gloo ranks, each running half of
the sequence's positions). Each rank runs one warm-up update (Adam's moments, thread pools), then
one measured update: peak RSS (VmHWM, reset through /proc/self/clear_refs) above the RSS before
it, the largest over the ranks. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc maps
and unmaps every tensor of 64 KiB or more) so that RSS follows live tensors, which is what the
plan's traced transient predicts (the plan's column: fitrl/memory/passes.py, ``pass_transient``,
without the CPU heap's growth, modelled separately). Gradients and weights exist before the
measured update and are not in the peak.

    .venv/bin/python bench/ulysses.py                           # T = 1k, 2k, 4k, 8k
    .venv/bin/python bench/ulysses.py --lengths 4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 2**20
PROMPT = 64


def rank_main(spec: dict) -> None:
    """One rank (or the single process): warm-up, then the measured update; prints JSON."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fitrl.config.schema import ActorConfig, AlgorithmConfig
    from fitrl.core.padding import position_ids_from_mask
    from fitrl.data.batch import Batch
    from fitrl.distributed.ulysses import sequence_groups
    from fitrl.roles.actor import Actor
    from fitrl.telemetry.memory import peak_rss_bytes, reset_peak_rss, status_kib

    torch.set_num_threads(spec["threads"])
    u, T = spec["ulysses"], spec["tokens"]
    if u > 1:
        dist.init_process_group("gloo", rank=spec["rank"], world_size=u)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, T, dtype=torch.long)
    response_mask = mask[:, PROMPT:].clone()
    batch = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                   "responses": ids[:, PROMPT:], "response_mask": response_mask,
                   "advantages": torch.ones(1, T - PROMPT) * 0.1, "old_logprobs": torch.zeros(1, T - PROMPT)})
    actor = Actor(model, ActorConfig(micro_batch_size=1, logprob_chunk_size=spec["chunk"]), AlgorithmConfig(),
                  total_steps=10, sequence_group=sequence_groups(u))
    actor.update(batch, sequences_per_mini_batch=1, temperature=1.0)  # warm-up: Adam's moments exist after it
    # the gradients exist from the second micro-batch on (as the plan's trace has them)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    actor.optimizer.zero_grad = lambda set_to_none=True: [p.grad.zero_() for p in model.parameters()]
    if u > 1:
        dist.barrier()
    before = status_kib("VmRSS") * 1024
    reset_peak_rss()
    start = time.perf_counter()
    metrics = actor.update(batch, sequences_per_mini_batch=1, temperature=1.0)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() - before
    print(json.dumps({"rank": spec.get("rank", 0), "peak": peak, "seconds": seconds,
                      "loss": metrics["actor/pg_loss"]}))
    if u > 1:
        dist.destroy_process_group()


def plan_bytes(model: str, tokens: int, ulysses: int, chunk: int) -> int:
    """The plan's update transient on one rank (fitrl/memory/passes.py, ``pass_transient``)."""
    from fitrl.memory.passes import ulysses_beyond_trace
    from fitrl.memory.trace import trace_spec, transient_bytes
    from fitrl.models.shape import ModelShape

    shape = ModelShape.from_path(model)
    local = -(-tokens // ulysses)
    spec = trace_spec(shape, phase="update", batch=1, seq_len=local,
                      response_len=min(tokens - PROMPT, local - 1), chunk=chunk)
    traced = transient_bytes(spec, shape.layers)
    return traced + (ulysses_beyond_trace(shape, "update", 1, local, 4) if ulysses > 1 else 0)


def measure(model: str, tokens: int, ulysses: int, threads: int, chunk: int) -> dict:
    from fitrl.distributed.process_group import free_port

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = []
    for rank in range(ulysses):
        spec = {"model": model, "tokens": tokens, "ulysses": ulysses, "rank": rank, "threads": threads,
                "chunk": chunk}
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"rank failed:\n{err[-3000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"peak": max(o["peak"] for o in outs), "seconds": max(o["seconds"] for o in outs),
            "loss": outs[0]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--size", default="deep")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--threads", type=int, default=1, help="per rank (2 ranks on a 2-core machine: 1 each)")
    ap.add_argument("--chunk", type=int, default=1024, help="actor.logprob_chunk_size")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rank_main(json.loads(args.child))
        return
    import torch

    from fitrl.models.tiny import make_tiny_model

    model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="fitrl-ulysses-")) / "model", arch=args.arch,
                                size=args.size))
    print(f"# {args.arch}-{args.size}, one sequence (prompt {PROMPT}), Actor.update, fp32, {args.threads} thread(s) "
          f"per rank, MALLOC_MMAP_THRESHOLD_=65536, torch {torch.__version__}")
    print(f"{'tokens':>6} {'ulysses':>7} {'peak MiB/rank':>13} {'plan MiB':>8} {'plan/meas':>9} {'vs u=1':>7} "
          f"{'seconds':>7} {'pg_loss':>9}")
    for tokens in [int(t) for t in args.lengths.split(",")]:
        base = None
        for u in (1, 2):
            r = measure(model, tokens, u, args.threads, args.chunk)
            plan = plan_bytes(model, tokens, u, args.chunk)
            base = base or r["peak"]
            print(f"{tokens:6d} {u:7d} {r['peak'] / MiB:13.0f} {plan / MiB:8.0f} {plan / r['peak']:9.2f} "
                  f"{r['peak'] / base:7.2f} {r['seconds']:7.1f} {r['loss']:9.5f}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
