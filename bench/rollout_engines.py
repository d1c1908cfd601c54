"""Rollout throughput of the two engines, ``hf`` (the trained module: fitrl's decode loop or
transformers ``generate``, ``--decode``) and ``vllm`` (vLLM's CPU build in-process, weights pushed
from the trainer), on the tiny and small qwen2 models.

Workload: one policy worker (``PolicyWorker``, the toy task's config), fp32, sampling at
temperature 1.0 with top-k 50; each ``generate`` call samples 16 training prompts x 8 responses
x 64 new tokens (EOS ignored, so both engines make exactly the same number of tokens). The HF
engine generates in micro-batches of ``rollout.micro_batch_size`` sequences (fitrl's default
64); vLLM takes all of them in one call and schedules them itself (256 MiB KV cache, fitrl's CPU
default). vLLM's CPU attention runs only heads of 32, 64, ... channels: the tiny model is
re-split into heads of 32 (``make_tiny_model(head_dim=32)``: same weights), the small one keeps
its own heads of 64.

Each (model, engine) measurement runs in a fresh process (this script, ``--one``), so imports
and allocator state do not carry over from one engine to the other; the engines alternate
(hf, vllm, then vllm, hf, ...) over the repeats. In each process: ``import vllm`` (vLLM side
only, timed apart), build the worker (``build s``: the trained model, and the engine: for vLLM
its ``LLM`` on dummy weights), one warm-up ``generate`` (for vLLM it also pushes the trainer's
weights, reported as ``push s``), then the timed ``generate`` calls. Reported per (model,
engine): medians over the repeats (import, build, warm-up, push) and over every timed call
(``gen s`` wall seconds, ``cpu s`` the process's CPU seconds, generated tokens/s); peak RSS is
the largest ``ru_maxrss`` of the processes (a vLLM process holds the trained model, the
engine's copy of the weights and its KV cache; an HF process the trained model alone).
``vs hf`` is the ratio of the median tokens/s to the first HF side's. ``--decode`` picks the HF
engine's ``rollout.decode`` (``loop``, fitrl's default, or ``generate``); given both, each is a
side of its own (``hf/loop``, ``hf/generate``), alternating like the engines. On a shared
machine wall-clock figures move with other load (2 threads on 2 busy cores can be many times
slower): the load average at the start and the end is printed under the table.

Run with the vLLM environment's interpreter (the HF side runs in it too, so both sides have the
same torch and transformers); without vLLM the vLLM side is skipped:

    .venv-vllm/bin/python bench/rollout_engines.py                     # tiny and small, 3 repeats x 3 calls
    .venv-vllm/bin/python bench/rollout_engines.py --sizes small --max-tokens 128 --threads 1
    .venv/bin/python bench/rollout_engines.py --engines hf --decode generate loop   # HF's two decode paths
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("hf", "vllm")
DECODES = ("loop", "generate")


def head_dim_for(size: str) -> int | None:
    """The head size the vLLM CPU backend can run for ``size`` (None: the size's own heads)."""
    from fitrl.models.tiny import SIZES

    own = SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"]
    return None if own >= 32 else 32


def run_one(args) -> dict:
    """One (model, engine) measurement, in this (fresh) process."""
    import torch

    torch.set_num_threads(args.threads)  # as fitrl.trainer.run.train does with trainer.num_threads
    import_s = 0.0
    engine, _, decode = args.engine.partition("/")  # hf/loop, hf/generate, vllm
    if engine == "vllm":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        start = time.perf_counter()
        import vllm

        import_s = time.perf_counter() - start
        version = vllm.__version__
    else:
        import transformers

        version = transformers.__version__

    from fitrl.config import load_config
    from fitrl.roles.workers import PolicyWorker
    from fitrl.trainer.run import build_datasets

    seqs = args.prompts * args.n
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(str(ROOT / "examples/arith.yaml"), [
            f"actor.model.path={args.model_dir}", f"trainer.run_dir={tmp}/run",
            f"data.train_files=[{ROOT / 'examples/data/arith_train.jsonl'}]", "data.val_files=[]",
            f"data.rollout_batch_size={args.prompts}", f"actor.mini_batch_size={args.prompts}",
            f"actor.micro_batch_size={seqs}", f"rollout.n={args.n}",
            f"rollout.max_response_length={args.max_tokens}", "rollout.ignore_eos=true",
            "rollout.temperature=1.0", "rollout.top_k=50", "rollout.top_p=1.0",
            f"rollout.engine={engine}", f"trainer.num_threads={args.threads}",
            *([f"rollout.decode={decode}"] if decode else []),
            "actor.model.dtype=float32", "trainer.progress_bar=false", "memory.plan=off",
            *([f"rollout.micro_batch_size={args.hf_micro_batch}"] if args.hf_micro_batch else []),
        ])
        start = time.perf_counter()
        worker = PolicyWorker(cfg, rank=0, world_size=1)
        build_s = time.perf_counter() - start
        assert torch.get_num_threads() == args.threads, torch.get_num_threads()

        train, _ = build_datasets(worker.cfg, worker.tokenizer)
        prompts = train.batch([i % len(train) for i in range(args.prompts)], "p")
        sampling = worker.cfg.rollout.sampling()

        start = time.perf_counter()
        out = worker.generate(prompts, sampling)
        warmup_s = time.perf_counter() - start
        push_s = getattr(worker.rollout, "last_push", {}).get("seconds", 0.0)
        seconds, cpu, tokens = [], [], []
        for _ in range(args.calls):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = worker.generate(prompts, sampling)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            tokens.append(int(out["response_mask"].sum()))
        release = getattr(worker.rollout, "release", None)
        if release is not None:
            release()
    return {
        "engine": args.engine, "version": version,
        "import_s": import_s, "build_s": build_s, "warmup_s": warmup_s, "push_s": push_s,
        "seconds": seconds, "cpu_s": cpu, "tokens": tokens, "sequences": int(out["responses"].shape[0]),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import psutil

        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        mem = ""
    return f"{cpu}, {os.cpu_count()} logical CPUs ({usable} usable){mem}, {platform.system()} {platform.release()}"


def versions(results: dict) -> str:
    import torch

    found = {("vllm" if engine == "vllm" else "transformers"): run["version"]
             for (_, engine), runs in results.items() for run in runs}
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    parts += [f"{name} {version}" for name, version in found.items()]
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--decode", nargs="+", default=["loop"], choices=DECODES,
                        help="rollout.decode of the hf engine; two values measure both")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per (model, engine)")
    parser.add_argument("--calls", type=int, default=3, help="timed generate calls per process (after 1 warm-up)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per response (EOS ignored)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (trainer.num_threads)")
    parser.add_argument("--hf-micro-batch", type=int, default=0,
                        help="rollout.micro_batch_size: HF sequences per generate call (0: fitrl's default, 64)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child-process mode
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return

    command = shlex.join([os.path.relpath(sys.executable, Path.cwd()) if sys.executable.startswith(str(Path.cwd()))
                          else sys.executable, os.path.relpath(__file__, Path.cwd()), *sys.argv[1:]])
    have_vllm = importlib.util.find_spec("vllm") is not None
    engines = list(args.engines)
    if "vllm" in engines and not have_vllm:
        print(f"vllm is not importable by {sys.executable}: vLLM side skipped (run with .venv-vllm/bin/python)")
        engines.remove("vllm")
    engines = [s for e in engines for s in ([f"hf/{d}" for d in args.decode] if e == "hf" else [e])]

    from transformers.utils import logging as hf_logging

    from fitrl.models.tiny import describe, make_tiny_model

    hf_logging.disable_progress_bar()

    started, load_before = time.perf_counter(), os.getloadavg()
    results: dict[tuple[str, str], list[dict]] = {}
    params: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            hd = head_dim_for(size)
            model = make_tiny_model(Path(tmp) / f"qwen2-{size}", arch="qwen2", size=size, seed=0, head_dim=hd)
            params[size] = describe(model)["params"] / 1e6
            for r in range(args.repeats):
                for engine in (engines if r % 2 == 0 else engines[::-1]):
                    cmd = [sys.executable, __file__, "--one", "--engine", engine, "--model-dir", str(model),
                           "--calls", str(args.calls), "--prompts", str(args.prompts), "--n", str(args.n),
                           "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
                           "--hf-micro-batch", str(args.hf_micro_batch)]
                    t0 = time.perf_counter()
                    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
                    if proc.returncode:
                        sys.stderr.write(proc.stderr[-4000:])
                        raise SystemExit(f"{size}/{engine} repeat {r + 1} failed (exit {proc.returncode})")
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                    results.setdefault((size, engine), []).append(row)
                    calls = " ".join(f"{s:.2f}" for s in row["seconds"])
                    print(f"  {size:>5} {engine:>11} repeat {r + 1}/{args.repeats}: {calls} s/call, "
                          f"process {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    wall, load_after = time.perf_counter() - started, os.getloadavg()

    print(f"command: {command}")
    print(f"machine: {machine()}")
    print(f"software: {versions(results)}")
    print(f"workload: {args.prompts} prompts x {args.n} samples x {args.max_tokens} new tokens (EOS ignored), "
          f"temperature 1.0, top-k 50, fp32, {args.threads} threads; HF micro-batch "
          f"{args.hf_micro_batch or 64}; {args.repeats} processes per (model, engine), engines alternating, "
          f"1 warm-up + {args.calls} timed calls each")
    header = ["model", "params", "engine", "import s", "build s", "warm-up s", "push s", "gen s", "cpu s",
              "tok/call", "tokens/s", "peak RSS", "vs hf"]
    widths = [11, 7, 11, 8, 7, 9, 6, 6, 6, 8, 8, 9, 7]
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for size in args.sizes:
        rates = {e: statistics.median(t / s for run in results[(size, e)]
                                      for t, s in zip(run["tokens"], run["seconds"])) for e in engines}
        first_hf = next((e for e in engines if e != "vllm"), None)
        for engine in engines:
            runs = results[(size, engine)]
            secs = [s for run in runs for s in run["seconds"]]
            tokens = sorted({t for run in runs for t in run["tokens"]})
            ratio = f"{rates[engine] / rates[first_hf]:.2f}x" if first_hf and engine != first_hf else ""
            cells = [f"qwen2 {size}", f"{params[size]:.2f}M", engine,
                     f"{statistics.median(r['import_s'] for r in runs):.2f}" if engine == "vllm" else "-",
                     f"{statistics.median(r['build_s'] for r in runs):.2f}",
                     f"{statistics.median(r['warmup_s'] for r in runs):.2f}",
                     f"{statistics.median(r['push_s'] for r in runs):.2f}" if engine == "vllm" else "-",
                     f"{statistics.median(secs):.2f}",
                     f"{statistics.median(c for r in runs for c in r['cpu_s']):.2f}", "/".join(map(str, tokens)),
                     f"{rates[engine]:,.0f}", f"{max(r['peak_rss_gib'] for r in runs):.2f} GiB", ratio]
            print(" | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print(f"wall: {wall:.0f} s; load average (1 min) {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end")


if __name__ == "__main__":
    main()
