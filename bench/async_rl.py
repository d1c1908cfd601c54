"""The same GRPO work in each rollout layout on this machine's cores (issue 41, docs/async.md).

    .venv/bin/python bench/async_rl.py                                  # 0.64M, 100 steps, 3 seeds, 6 layouts
    .venv/bin/python bench/async_rl.py --shapes 31.7M --task throughput --warm-start 0 --steps 10 --seeds 1 --window 4
    .venv/bin/python bench/async_rl.py --layouts sync-1proc one_step_off --steps 20 --seeds 1   # a quick look

The work is bench/vs_trl.py's (its ``fitrl_overrides``: the toy arithmetic task, 8 prompts x 8
samples, one optimizer step per RL step; ``--task curve`` by default: up to 8 new tokens, top-k
50, lr 2e-3, whose reward rises within 100 steps), plus a greedy validation over
examples/data/arith_val.jsonl after the last step. Layouts, all on the same cores:

- ``sync-1proc``: one process, 2 torch threads in every phase (the embedded default's layout);
  ``sync-1proc-m16``: the same with micro-batches of 16 sequences (the other layouts take the
  whole step's 64 in one forward/backward, ``--micro-batch``: the fastest for every layout here);
- ``sync-ray``: two colocated Ray ranks of 1 thread each (data-parallel FSDP2), the driver beside;
- ``sync-split``: one trainer rank and one rollout worker (1 thread each), not overlapped: what
  the split alone costs (the weights sent every step, two processes taking turns);
- ``one_step_off``: the same two processes, step k+1 generated while step k trains;
- ``async``: the same, up to ``--staleness`` steps ahead, new weights taken between micro-batches;
- ``sync-split-1proc``, ``one_step_off-1proc``, ``async-1proc``: the same three in one process,
  the rollout worker a thread beside the trainer's, each computing with 1 torch thread.

Every run is a fresh process. A sampler thread reads, every 0.1 s, the CPU seconds of the
process tree (psutil: the driver, Ray's processes, the ranks) and how many steps metrics.jsonl
holds, so steps/s and the cores' busy share are measured over the same window: from the end of
step ``--window-start`` to the end of the last step (start-up, warm-up and the final validation
left out). Per layout it prints the medians over seeds: steps/s and its ratio to the best
synchronous layout, the cores' busy share, the trainer's wait for samples (``time/rollout``),
the rollout worker's idle share (``rollout/worker_idle_frac``), the samples' staleness, and per
seed the reward curve's judgement (``judge_rise``, first 10 against last 10 steps) and the final
validation reward.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fitrl.trainer.verdict import judge_rise  # noqa: E402


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


LAYOUTS: dict[str, list[str]] = {
    "sync-1proc": ["trainer.backend=inprocess", "trainer.num_threads=2"],
    "sync-1proc-m16": ["trainer.backend=inprocess", "trainer.num_threads=2", "actor.micro_batch_size=16"],
    "sync-ray": ["trainer.backend=ray", "trainer.devices_per_node=2", "trainer.num_threads=1"],
    "sync-split": ["trainer.backend=ray", "trainer.devices_per_node=1", "rollout.workers=1", "trainer.num_threads=1"],
    "one_step_off": ["trainer.backend=ray", "trainer.devices_per_node=1", "rollout.mode=one_step_off",
                     "trainer.num_threads=1"],
    "async": ["trainer.backend=ray", "trainer.devices_per_node=1", "rollout.mode=async", "trainer.num_threads=1"],
    "sync-split-1proc": ["trainer.backend=inprocess", "rollout.workers=1", "trainer.num_threads=1"],
    "one_step_off-1proc": ["trainer.backend=inprocess", "rollout.mode=one_step_off", "trainer.num_threads=1"],
    "async-1proc": ["trainer.backend=inprocess", "rollout.mode=async", "trainer.num_threads=1"],
}
SYNC = ("sync-1proc", "sync-1proc-m16", "sync-ray", "sync-split", "sync-split-1proc")
"""The synchronous layouts: the ratio column is against the fastest of those run."""


def warm_start(work: Path, model: Path, steps: int) -> Path:
    """``fitrl sft`` of ``model`` on the answers (examples/arith_sft.yaml, ``steps`` steps), exported:
    the policy every run starts from, sometimes right (RL post-training's usual start; a random
    model's reward on this task often never leaves 0). Made once per model and step count."""
    out = work / "models" / f"{model.name}-sft{steps}"
    if (out / "config.json").is_file():
        return out
    run_dir = work / "runs" / f"{model.name}-sft{steps}"
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "fitrl.cli", "sft", str(ROOT / "examples/arith_sft.yaml"),
                    f"actor.model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}",
                    "trainer.progress_bar=false", "trainer.log_freq=50"], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "-m", "fitrl.cli", "export", str(run_dir), str(out)], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    return out


def steps_in(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"reward/mean"' in line and '"val/' not in line)


def tree_cpu(root: psutil.Process, seen: dict[int, float]) -> float:
    """CPU seconds of the process tree so far (a process that ended keeps its last reading)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            t = p.cpu_times()
            seen[p.pid] = max(seen.get(p.pid, 0.0), t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    return sum(seen.values())


def run_one(work: Path, model: Path, layout: str, seed: int, steps: int, staleness: int, extra: list[str],
            task: dict, micro_batch: int = 64) -> dict:
    sides = _bench_module("vs_trl_sides")
    run_dir = work / "runs" / f"{model.name}-{layout}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # (an old metrics.jsonl would read as steps done)
    spec = {"model": str(model), "run_dir": str(run_dir), "data": str(ROOT / "examples/data/arith_train.jsonl"),
            "micro_batch": micro_batch, "steps": steps, "seed": seed, "threads": 1, "precision": "fp32", **task}
    overrides = sides.fitrl_overrides(spec) + LAYOUTS[layout] + [
        f"data.val_files=[{ROOT / 'examples/data/arith_val.jsonl'}]", f"rollout.max_staleness={staleness}",
        "trainer.loggers=[console]", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    log = open(work / "runs" / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fitrl.cli", "train", str(ROOT / "examples/arith.yaml"),
                             *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    timeline: list[tuple[float, float, int]] = []  # (time, tree CPU seconds, steps done)
    done, seen = threading.Event(), {}
    root = psutil.Process(proc.pid)
    metrics = run_dir / "metrics.jsonl"

    def sample() -> None:
        while not done.is_set():
            timeline.append((time.time(), tree_cpu(root, seen), steps_in(metrics)))
            done.wait(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    rc = proc.wait()
    done.set()
    thread.join()
    log.close()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"layout": layout, "seed": seed, "rc": rc, "timeline": timeline,
            "steps": [r for r in rows if "reward/mean" in r and "event" not in r],
            "val": next((r["val/reward/mean"] for r in reversed(rows) if "val/reward/mean" in r), None)}


def summarise(run: dict, start: int, cores: int) -> dict:
    tl, steps = run["timeline"], run["steps"]
    last = len(steps)
    first = next(x for x in tl if x[2] >= start)  # the first sample that saw step `start` end
    end = next(x for x in tl if x[2] >= last)
    wall, cpu = end[0] - first[0], end[1] - first[1]
    window = steps[start:]

    def med(key: str):
        vals = [s[key] for s in window if key in s]
        return statistics.median(vals) if vals else None
    rise = judge_rise([s["reward/mean"] for s in steps])
    return {"steps_per_s": (end[2] - first[2]) / wall, "busy": cpu / (wall * cores),
            "wait_s": med("time/rollout"), "update_s": med("time/update"), "worker_idle": med("rollout/worker_idle_frac"),
            "stale": med("rollout/staleness_mean"), "rose": rise["rose"], "rise": rise.get("diff"),
            "first10": statistics.fmean(s["reward/mean"] for s in steps[:10]),
            "last10": statistics.fmean(s["reward/mean"] for s in steps[-10:]), "val": run["val"]}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    vs = _bench_module("vs_trl")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["0.64M"], choices=list(vs.SHAPES))
    p.add_argument("--layouts", nargs="+", default=["sync-1proc", "sync-ray", "one_step_off", "async",
                                                     "one_step_off-1proc", "async-1proc"],
                   choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--window", type=int, default=10, help="steps left out at the start of the window")
    p.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness of the async layout")
    p.add_argument("--work", default="/tmp/fitrl-async-bench")
    p.add_argument("--json", default=None)
    p.add_argument("--task", default="curve", choices=list(vs.TASKS),
                   help="vs_trl's tasks: curve (<= 8 new tokens, top-k 50, lr 2e-3: the reward rises within 100 "
                        "steps) or throughput (<= 32 new tokens, lr 1e-3: a random 0.64M model's reward stays 0)")
    p.add_argument("--warm-start", type=int, default=50,
                   help="supervised steps before RL (examples/arith_sft.yaml; 0: RL from the random weights)")
    p.add_argument("--micro-batch", type=int, default=64,
                   help="actor.micro_batch_size: 64, the step's every sequence in one forward/backward, is the fastest "
                        "here for every layout (sync-1proc-m16 shows the synchronous one at 16)")
    p.add_argument("--set", nargs="*", default=[], help="more overrides for every run")
    args = p.parse_args()
    work = Path(args.work)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    cores = psutil.cpu_count()
    out = {}
    for shape in args.shapes:
        model, desc = vs.build_model(work, shape)
        if args.warm_start:
            model = warm_start(work, model, args.warm_start)
        print(f"\n== {shape} ({desc['params'] / 1e6:.2f}M params, {args.warm_start} supervised steps first), task "
              f"{args.task} {vs.TASKS[args.task]}: "
              f"{args.steps} steps, seeds {args.seeds}, window from step {args.window}, {cores} cores")
        runs = []
        for seed in args.seeds:
            for layout in args.layouts:  # the layouts alternate within each seed (machine drift spreads)
                r = run_one(work, model, layout, seed, args.steps, args.staleness, args.set, vs.TASKS[args.task],
                            args.micro_batch)
                if r["rc"] != 0 or len(r["steps"]) < args.steps:
                    print(f"{layout} seed {seed}: exit {r['rc']}, {len(r['steps'])} steps (log in {work / 'runs'})")
                    continue
                r["summary"] = summarise(r, args.window, cores)
                s = r["summary"]
                print(f"  {layout:13} seed {seed}: {s['steps_per_s']:.3f} steps/s, cores busy {s['busy']:.0%}, "
                      f"reward {s['first10']:.3f} -> {s['last10']:.3f} ({'rose' if s['rose'] else 'did NOT rise'}), "
                      f"val {fmt(s['val'], '.3f')}", flush=True)
                runs.append(r)
        table = {}
        for layout in args.layouts:
            ss = [r["summary"] for r in runs if r["layout"] == layout]
            if ss:
                table[layout] = {k: statistics.median(v) if (v := [s[k] for s in ss if isinstance(s[k], (int, float))
                                                                   and not isinstance(s[k], bool)]) else None
                                 for k in ss[0] if k != "rose"}
                table[layout]["rose"] = f"{sum(s['rose'] for s in ss)}/{len(ss)}"
                table[layout]["vals"] = [s["val"] for s in ss]
        best = max((table[k]["steps_per_s"] for k in table if k in SYNC), default=None)
        print(f"\n{'layout':13} {'steps/s':>8} {'vs best sync':>12} {'cores busy':>10} {'trainer wait s':>14} "
              f"{'update s':>8} {'worker idle':>11} {'staleness':>9} {'rose':>5}  final val reward per seed")
        for layout, t in table.items():
            ratio = f"{t['steps_per_s'] / best:.2f}x" if best else "-"
            print(f"{layout:13} {t['steps_per_s']:8.3f} {ratio:>12} {t['busy']:10.0%} {fmt(t['wait_s'], '.3f'):>14} "
                  f"{fmt(t['update_s'], '.3f'):>8} {fmt(t['worker_idle'], '.0%'):>11} {fmt(t['stale'], '.2f'):>9} "
                  f"{t['rose']:>5}  " + " ".join(fmt(v, ".3f") for v in t["vals"]))
        out[shape] = {"table": table, "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in runs]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
