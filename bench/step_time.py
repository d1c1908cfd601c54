"""Seconds per RL step with its phase breakdown, and peak RSS, for the tiny and small models.

Workload: the toy task, 8 prompts x 8 samples x 32 new tokens (EOS ignored so every step
generates exactly 32 tokens), GRPO, one optimizer step per RL step. Each model size runs in
its own process so peak RSS is that size's alone.

    .venv/bin/python bench/step_time.py                # both sizes, 2 warm-up + 5 timed steps
    .venv/bin/python bench/step_time.py --sizes tiny --steps 3
    .venv/bin/python bench/step_time.py --sizes small --set memory.trim_heap=false   # more overrides

Besides wall-clock seconds it reports the process's CPU seconds (user + system, every thread) and
minor page faults per step, over all steps (warm-up included): a cost such as trimming the heap
(``memory.trim_heap``: faults pages in again) shows there even when other processes load the
machine and the wall clock is noise.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(size: str, arch: str, steps: int, warmup: int, threads: int, overrides: list[str]) -> dict:
    from fitrl.config import load_config
    from fitrl.models.tiny import describe, make_tiny_model
    from fitrl.telemetry.memory import host_memory
    from fitrl.trainer.run import train
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / f"{arch}-{size}", arch=arch, size=size)
        cfg = load_config(str(ROOT / "examples/arith.yaml"), [
            f"actor.model.path={model}", f"trainer.run_dir={tmp}/run",
            f"data.train_files=[{ROOT / 'examples/data/arith_train.jsonl'}]", "data.val_files=[]",
            "data.rollout_batch_size=8", "rollout.n=8", "rollout.max_response_length=32", "rollout.ignore_eos=true",
            "actor.mini_batch_size=8", "actor.micro_batch_size=16", "actor.logprob_micro_batch_size=32",
            f"trainer.max_steps={warmup + steps}", "trainer.val_before_train=false", "trainer.progress_bar=false",
            f"trainer.num_threads={threads}", "actor.optim.lr=1e-5", *overrides,
        ])
        before = resource.getrusage(resource.RUSAGE_SELF)
        history = train(cfg, Console(quiet=True))
        after = resource.getrusage(resource.RUSAGE_SELF)
        timed = history[warmup:]
        phases = [k for k in timed[0] if k.startswith("time/")]  # pipeline order
        return {
            "size": size, "arch": arch, "params_m": describe(model)["params"] / 1e6,
            "steps": len(timed),
            **{k: statistics.fmean(h[k] for h in timed) for k in phases},
            "response_len": statistics.fmean(h["response/length_mean"] for h in timed),
            "peak_rss_gib": host_memory()["mem/host_peak_rss_gib"],
            # the whole train call (model build, warm-up and timed steps) per step
            "cpu_s": (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / (warmup + steps),
            "sys_s": (after.ru_stime - before.ru_stime) / (warmup + steps),
            "minflt": (after.ru_minflt - before.ru_minflt) / (warmup + steps),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child-process mode
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.sizes[0], args.arch, args.steps, args.warmup, args.threads, args.set)))
        return
    rows = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--one", "--sizes", size, "--arch", args.arch, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--threads", str(args.threads), "--set", *args.set]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    phases = [k for k in rows[0] if k.startswith("time/") and k != "time/step"]
    print(f"workload: 8 prompts x 8 samples x 32 new tokens, {args.arch}, {args.threads} threads, "
          f"mean of {args.steps} steps after {args.warmup} warm-up{'; ' + ' '.join(args.set) if args.set else ''}")
    header = ["size", "params", "s/step", *[p[5:] for p in phases], "peak RSS", "CPU s/step", "sys s/step",
              "faults/step"]
    print(" | ".join(f"{h:>11}" for h in header))
    for r in rows:
        cells = [r["size"], f"{r['params_m']:.2f}M", f"{r['time/step']:.2f}",
                 *[f"{r[p]:.2f}" for p in phases], f"{r['peak_rss_gib']:.2f} GiB", f"{r['cpu_s']:.2f}",
                 f"{r['sys_s']:.2f}", f"{r['minflt']:,.0f}"]
        print(" | ".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
