"""Padding-free packing against padded micro-batches at mixed lengths (``actor.packing``).

Workload: a tiny model made here (``--arch``/``--size``, default the 18M-parameter qwen2 "deep"),
fp32 on CPU; one rollout batch of ``--sequences`` sequences, each a prompt of 16-64 tokens and a
response drawn log-uniform between ``--min-response`` and ``--max-response`` tokens (seeded: a
long tail, most short), the prompts distinct (so shared-prompt forwards do not apply).
Per mode (``actor.packing`` false, then true), in a fresh subprocess each:

- ``logprob``: ``Actor.compute_logprob`` (no gradients) over the batch;
- ``update``: ``Actor.update``, one optimizer step over the batch (forward and backward of every
  micro-batch).

Micro-batches: ``--micro`` sequences each (consecutive), or with ``--budget N`` the actor's token
budget (``actor.micro_batch_token_budget``: padded or packed size within N). Reported: real
tokens/s (prompt + response tokens of the batch / seconds, the best of ``--repeats`` after one
warm-up), the positions the forwards ran, the peak RSS above the process's RSS before the
pass (VmHWM reset through /proc/self/clear_refs), and the plan's traced transient of the largest
forward the mode ran (``plan_mib``: live tensors, so compare it with ``--malloc mmap``, where RSS
follows them). Log-probs compared across modes (max |d|).

    .venv/bin/python bench/packing.py                     # 32 sequences, responses 16..2048, micro 8
    .venv/bin/python bench/packing.py --budget 8192
    .venv/bin/python bench/packing.py --phases update --repeats 1 --malloc mmap   # peaks beside the plan
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MiB = 2**20


def make_batch(vocab: int, sequences: int, lo: int, hi: int, seed: int):
    """The padded rollout layout: left-padded prompts, right-padded responses."""
    from fitrl.core.padding import position_ids_from_mask
    from fitrl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(16, 65, (sequences,), generator=g).tolist()
    u = torch.rand(sequences, generator=g).tolist()
    responses = [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u]
    P, R = max(prompts), max(responses)
    ids = torch.randint(3, vocab, (sequences, P + R), generator=g)
    mask = torch.zeros(sequences, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        mask[b, P - p:P + r] = 1
    response_mask = mask[:, P:].clone()
    adv = torch.randn(sequences, 1, generator=g) * response_mask
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                  "responses": ids[:, P:], "response_mask": response_mask, "advantages": adv,
                  "old_logprobs": torch.zeros(sequences, R)}), prompts, responses


def run_one(spec: dict) -> dict:
    """Child process: one mode, one pass, timed and its peak RSS measured."""
    from transformers import AutoModelForCausalLM

    from fitrl.config.schema import ActorConfig, AlgorithmConfig
    from fitrl.roles.actor import Actor
    from fitrl.telemetry.memory import peak_rss_bytes, reset_peak_rss, status_kib

    torch.manual_seed(0)
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    batch, prompts, responses = make_batch(model.config.vocab_size, spec["sequences"], spec["min_response"],
                                           spec["max_response"], spec["seed"])
    cfg = ActorConfig(micro_batch_size=spec["micro"], logprob_micro_batch_size=spec["micro"],
                      micro_batch_token_budget=spec["budget"], packing=spec["packing"], share_prompts=False)
    actor = Actor(model, cfg, AlgorithmConfig(), total_steps=10)
    shapes = []  # (rows, width) of each forward
    hook = model.model.layers[0].register_forward_hook(lambda m, a, o: shapes.append(tuple(a[0].shape[:2])))

    def once():
        if spec["phase"] == "logprob":
            return actor.compute_logprob(batch, temperature=1.0)["old_logprobs"]
        actor.update(batch, sequences_per_mini_batch=len(batch), temperature=1.0)
        return None

    once()  # warm-up (allocator, thread pools)
    times, peak = [], 0
    for _ in range(spec["repeats"]):
        shapes.clear()
        before = status_kib("VmRSS") * 1024
        reset_peak_rss()
        start = time.perf_counter()
        out = once()
        times.append(time.perf_counter() - start)
        peak = max(peak, peak_rss_bytes() - before)
    hook.remove()
    if out is not None:
        torch.save(out, spec["out"])
    tokens = sum(prompts) + sum(responses)
    return {"seconds": min(times), "tokens": tokens, "tokens_per_s": tokens / min(times),
            "positions": sum(r * w for r, w in shapes), "peak_mib": peak / MiB, "shapes": sorted(set(shapes))}


def plan_mib(model: str, phase: str, shapes: list, chunk: int = 1024) -> float:
    """The plan's traced transient (fitrl/memory/trace.py; the live tensors, before the CPU heap's
    growth) of the largest of these (rows, width) forwards, every row full (a padded batch's
    attention mask included, as a packed one's has one too)."""
    from fitrl.memory.trace import trace_spec, transient_bytes
    from fitrl.models.shape import ModelShape

    shape = ModelShape.from_path(model)
    return max(transient_bytes(trace_spec(shape, phase="update" if phase == "update" else "logprob", batch=rows,
                                          seq_len=width, response_len=width - 16, chunk=chunk), shape.layers)
               for rows, width in shapes) / MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--size", default="deep")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--min-response", type=int, default=16)
    ap.add_argument("--max-response", type=int, default=2048 - 64)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="logprob,update")
    ap.add_argument("--malloc", choices=("glibc", "mmap"), default="glibc",
                    help="mmap: MALLOC_MMAP_THRESHOLD_=65536, RSS follows live tensors (the plan column's terms)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(json.loads(args.child))))
        return
    from fitrl.models.tiny import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="fitrl-packing-"))
    model = make_tiny_model(tmp / "model", arch=args.arch, size=args.size)
    print(f"# {args.arch}-{args.size}, {args.sequences} sequences, responses {args.min_response}..{args.max_response} "
          f"log-uniform, {'budget ' + str(args.budget) if args.budget else f'micro {args.micro}'}, "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"{'phase':8} {'packing':8} {'seconds':>8} {'tokens/s':>9} {'positions':>10} {'peak MiB':>9} {'plan MiB':>9}")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if args.malloc == "mmap" else None
    for phase in args.phases.split(","):
        results = {}
        for packing in (False, True):
            spec = dict(vars(args), model=str(model), phase=phase, packing=packing, out=str(tmp / f"{packing}.pt"))
            spec.pop("child")
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                  text=True, check=True, env=env)
            r = results[packing] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{phase:8} {str(packing).lower():8} {r['seconds']:8.2f} {r['tokens_per_s']:9.0f} "
                  f"{r['positions']:10d} {r['peak_mib']:9.0f} {plan_mib(str(model), phase, r['shapes']):9.0f}")
        speedup = results[True]["tokens_per_s"] / results[False]["tokens_per_s"]
        line = f"{phase}: packing {speedup:.2f}x tokens/s, peak {results[True]['peak_mib'] / results[False]['peak_mib']:.2f}x"
        if phase == "logprob":
            a, b = torch.load(tmp / "False.pt"), torch.load(tmp / "True.pt")
            batch, _, _ = make_batch(8, args.sequences, args.min_response, args.max_response, args.seed)
            live = batch["response_mask"].bool()
            line += f", log-probs max|d| {(a - b)[live].abs().max():.1e}"
        print(line)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
