"""Host memory across a clean run of the toy task: does it grow after warm-up, does the leak
detector stay quiet, and what does per-phase telemetry cost per step?

    .venv/bin/python bench/memory_growth.py [--steps 100] [--warmup 5]

Runs the demo config (examples/arith.yaml, tiny model, CPU) twice in fresh processes, with
telemetry on and off. Growth = mean RSS at the end of the update over the last 10 steps against
the first 10 after warm-up (the kernel's RSS, as the OS and Ray see it); slope = Theil-Sen over
all steps after warm-up. Prints the figures bench/RESULTS.md records.
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
CHILD = """
import sys, time
from rich.console import Console
from fitrl.config import load_config
from fitrl.trainer.run import train
cfg = load_config("examples/arith.yaml", sys.argv[1:])
start = time.perf_counter()
train(cfg, Console(quiet=True))
print("WALL", time.perf_counter() - start)
"""


def run(steps: int, run_dir: str, telemetry: bool) -> tuple[list[dict], float]:
    overrides = [f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.progress_bar=false",
                 f"memory.telemetry={str(telemetry).lower()}", "checkpoint.save_final=false", "memory.plan=off"]
    out = subprocess.run([sys.executable, "-c", CHILD, *overrides], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = float(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("WALL")))
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return records, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from fitrl.telemetry.leaks import theil_sen

    model = ROOT / ".cache" / "models" / "tiny-qwen2"  # the demo config's model (made if missing)
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "fitrl.cli", "make-tiny-model", str(model)], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        on, wall_on = run(args.steps, f"{tmp}/on", telemetry=True)
        off, wall_off = run(args.steps, f"{tmp}/off", telemetry=False)
    for name, records in (("telemetry on", on), ("telemetry off", off)):  # end-of-step RSS, both runs
        rss = [r["mem/host_rss_gib"] * 1024 for r in records if "reward/mean" in r and r["step"] > args.warmup]
        print(f"{name}: RSS at the end of the step, 10-step means {statistics.fmean(rss[:10]):.1f} -> "
              f"{statistics.fmean(rss[-10:]):.1f} MiB ({(statistics.fmean(rss[-10:]) / statistics.fmean(rss[:10]) - 1) * 100:+.2f} %)")
    steps = [r for r in on if "reward/mean" in r and "event" not in r]
    after = [r for r in steps if r["step"] > args.warmup]
    level = [r["mem/rank0/update/host_rss_gib"] * 1024 for r in after]  # MiB
    leaks = [r for r in on if r.get("event") == "memory_leak"]
    # single readings scatter by ~±1 % (allocator noise): compare 10-step means at both ends
    first, last = statistics.fmean(level[:10]), statistics.fmean(level[-10:])
    slope = theil_sen([r["step"] for r in after], level)
    print(f"toy task, {args.steps} steps, warm-up {args.warmup}: rank0 RSS after update, mean of steps "
          f"{after[0]['step']}-{after[9]['step']} {first:.1f} MiB -> mean of steps {after[-10]['step']}-"
          f"{after[-1]['step']} {last:.1f} MiB ({(last / first - 1) * 100:+.2f} %); Theil-Sen {slope:+.3f} MiB/step "
          f"({slope * len(level) / first * 100:+.2f} % over the {len(level)} steps); "
          f"min {min(level):.1f}, max {max(level):.1f} MiB")
    peaks = {k.split("/")[2]: max(r[k] for r in after) * 1024 for k in after[-1] if k.endswith("/host_peak_gib")
             and k.startswith("mem/rank0/")}
    print("per-phase peak RSS (MiB, max over steps): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    print(f"leak warnings: {len(leaks)}" + "".join(f"\n  {w['message']}" for w in leaks))
    print(f"wall: telemetry on {wall_on:.1f} s, off {wall_off:.1f} s "
          f"({(wall_on - wall_off) / args.steps * 1000:+.1f} ms/step)")


if __name__ == "__main__":
    main()
