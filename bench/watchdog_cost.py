"""What the hang watchdog costs when nothing goes wrong: seconds per RL step with it on (the
default, ``trainer.hang_timeout_s=1800``) and off (``0``: no watchdog thread, no health calls),
run alternately so that the machine's load falls on both alike. Heartbeats are always on; they
are counters, not calls.

    .venv/bin/python bench/watchdog_cost.py                  # one process and 2-rank Ray, 3 pairs each
    .venv/bin/python bench/watchdog_cost.py --layouts local --pairs 5

Each run is bench/step_time.py's workload (the toy task, 8 prompts x 8 samples x 32 new tokens)
in a process of its own; the figure is its mean ``time/step`` after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "local": ["--threads", "2"],
    "ray": ["--threads", "1", "--set", "trainer.backend=ray", "trainer.devices_per_node=2", "trainer.device=cpu"],
}


def step_seconds(layout: str, watchdog: bool, steps: int) -> float:
    args = LAYOUTS[layout]
    extra = [] if watchdog else ["trainer.hang_timeout_s=0"]
    if "--set" in args:
        args = [*args, *extra]
    elif extra:
        args = [*args, "--set", *extra]
    cmd = [sys.executable, str(ROOT / "bench/step_time.py"), "--one", "--sizes", "tiny", "--steps", str(steps),
           "--warmup", "2", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])["time/step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    for layout in args.layouts:
        on, off = [], []
        for _ in range(args.pairs):
            on.append(step_seconds(layout, True, args.steps))
            off.append(step_seconds(layout, False, args.steps))
        m_on, m_off = statistics.fmean(on), statistics.fmean(off)
        spread = max(statistics.pstdev(on), statistics.pstdev(off))
        print(f"{layout}: watchdog on {m_on:.3f} s/step {[round(x, 3) for x in on]}, off {m_off:.3f} s/step "
              f"{[round(x, 3) for x in off]}: {100 * (m_on / m_off - 1):+.1f} % (runs' spread {spread:.3f} s)")


if __name__ == "__main__":
    main()
