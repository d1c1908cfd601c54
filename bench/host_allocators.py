"""Host RSS and step time over a few hundred steps under glibc's allocator, jemalloc and tcmalloc
(issue 38, "host allocator choice"): the same run, each allocator preloaded into the process.

The libraries come from the distribution's packages, unpacked without installing (no root
needed): ``make allocators`` runs ``apt-get download libjemalloc2 libtcmalloc-minimal4`` and
``dpkg-deb -x`` into ``.cache/allocators``. An allocator whose library is missing is skipped,
with a line saying so. Each run is one process (in-process backend: the driver is the trainer),
``LD_PRELOAD`` set for it and ``memory.host_allocator`` naming it (so the plan it writes carries
that allocator's band); ``memory.trim_heap`` is left on (glibc's ``malloc_trim`` then trims
only glibc's own arenas, which the other allocators leave empty).

    make allocators && .venv/bin/python bench/host_allocators.py                 # 300 steps each
    .venv/bin/python bench/host_allocators.py --steps 50 --size tiny --set rollout.n=4

Besides RSS and step time, each row holds the plan's trainer update peak at the expected lengths
(planned again from the run's saved config) and its error against the measured update peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fitrl.core import allocator as host_alloc  # noqa: E402  (standard library only: the libraries' names and lookup)

GIB = 1024**3
ALLOCATORS = ("glibc", *host_alloc.LIBRARIES)

CHILD = """
import sys, time
from rich.console import Console
from fitrl.config import load_config
from fitrl.trainer.run import train
cfg = load_config(sys.argv[1], sys.argv[2:])
start = time.perf_counter()
train(cfg, Console(quiet=True))
print("WALL", time.perf_counter() - start)
"""


def run(allocator: str, lib: Path | None, model: Path, steps: int, extra: list[str], work: Path) -> dict:
    run_dir = work / allocator
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if lib is not None:
        env["LD_PRELOAD"] = str(lib)
    overrides = [f"actor.model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.max_steps={steps}",
                 "trainer.val_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
                 "checkpoint.save_final=false", "memory.plan=warn", "memory.phase_peaks=rewind",
                 f"memory.host_allocator={allocator}", *extra]
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples" / "arith.yaml"), *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{allocator}: exit {out.returncode}\n{out.stderr[-3000:]}")
    wall = float(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("WALL")))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_ = [r for r in rows if "reward/mean" in r]
    rss = [r["mem/host_rss_gib"] for r in steps_]          # the driver (rank 0) at each step's end
    peak = [r["mem/rank0/update/host_peak_gib"] for r in steps_ if "mem/rank0/update/host_peak_gib" in r]
    times = [r["time/step"] for r in steps_][5:]
    k = max(1, len(rss) // 10)
    planned = expected_update_gib(run_dir)
    return {"allocator": allocator, "lib": str(lib) if lib else "glibc (libc.so.6)", "steps": len(steps_),
            "rss_first_gib": statistics.mean(rss[5:5 + k]), "rss_last_gib": statistics.mean(rss[-k:]),
            "update_peak_max_gib": max(peak), "lifetime_peak_gib": steps_[-1]["mem/host_peak_rss_gib"],
            "s_per_step": statistics.mean(times), "s_per_step_median": statistics.median(times), "wall_s": wall,
            "reward_last": statistics.mean(r["reward/mean"] for r in steps_[-k:]),
            "plan_update_gib": planned, "plan_error": planned / max(peak) - 1}


def expected_update_gib(run_dir: Path) -> float:
    """The plan's trainer update (host GiB) at the expected lengths of the run's saved config (the
    preflight skips that second plan when the caps already fit, so ``plan.json`` may hold only the
    caps)."""
    from fitrl.config import load_config
    from fitrl.memory.model import Hardware
    from fitrl.planner.plan import plan_config

    cfg = load_config(str(run_dir / "config.yaml"), [])
    plan = plan_config(cfg, Hardware.for_config(cfg, device="cpu"))  # (trainer.device=auto would plan a GPU)
    return (plan.expected or plan).process("trainer").host_peak("update") / GIB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--size", default="small", help="the tiny qwen2 model's size (fitrl.models.tiny.SIZES)")
    p.add_argument("--only", nargs="*", choices=ALLOCATORS, default=list(ALLOCATORS))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from fitrl.models.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="qwen2", size=args.size, seed=0)
        for name in args.only:
            lib = None if name == "glibc" else host_alloc.find_library(name)  # memory.host_allocator's lookup
            if name != "glibc" and lib is None:
                print(f"{name}: none of {', '.join(host_alloc.LIBRARIES[name])} found (make allocators): skipped")
                continue
            rows.append(run(name, lib, model, args.steps, args.set, Path(tmp)))
    print(f"examples/arith.yaml, qwen2 {args.size}, {args.steps} steps, one process"
          + (f"; {' '.join(args.set)}" if args.set else ""))
    print(f"{'allocator':<10} {'RSS steps 6-':>12} {'RSS last 10%':>13} {'update peak':>12} {'lifetime':>9} "
          f"{'s/step':>7} {'median':>7} {'reward':>7} {'plan update':>12} {'error':>7}")
    for r in rows:
        print(f"{r['allocator']:<10} {r['rss_first_gib']:>8.3f} GiB {r['rss_last_gib']:>9.3f} GiB "
              f"{r['update_peak_max_gib']:>8.3f} GiB {r['lifetime_peak_gib']:>5.3f} GiB {r['s_per_step']:>7.3f} "
              f"{r['s_per_step_median']:>7.3f} {r['reward_last']:>7.3f} {r['plan_update_gib']:>8.3f} GiB "
              f"{100 * r['plan_error']:>+6.1f}%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
