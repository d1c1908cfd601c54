"""A soak of restarts: a 2-rank Ray run whose rank 1 is SIGKILLed at random (each update with
probability ``--kill-prob``), with ``trainer.max_restarts`` large enough; at the end every step
must be in ``metrics.jsonl`` exactly once, with one ``restart`` event per kill.

    .venv/bin/python bench/restart_soak.py --steps 200 --kill-prob 0.03

Prints the steps, the restarts, the wall time and the time a restart cost on average (the run's
time over the same run never killed, per restart). CPU only; the tiny model, built locally.
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

ROOT = Path(__file__).resolve().parent.parent


def run(model: Path, run_dir: Path, steps: int, env: dict) -> tuple[int, float, str]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "fitrl.cli", "train", "examples/arith.yaml", f"actor.model.path={model}",
         f"trainer.run_dir={run_dir}", "data.val_files=[]", "data.rollout_batch_size=4", "rollout.n=2",
         "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.device=cpu", "trainer.backend=ray",
         "trainer.devices_per_node=2", "checkpoint.save_freq=1", "checkpoint.save_limit=2",
         f"trainer.max_steps={steps}", f"trainer.max_restarts={steps}", "trainer.progress_bar=false",
         "memory.plan=off"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env})
    return proc.returncode, time.perf_counter() - start, proc.stdout + proc.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-prob", type=float, default=0.03)
    p.add_argument("--baseline", action="store_true", help="also time the same run never killed")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([sys.executable, "-m", "fitrl.cli", "make-tiny-model", str(model)], check=True,
                       capture_output=True)
        code, took, out = run(model, Path(tmp) / "soak", args.steps,
                              {"FITRL_INJECT_FAULT": f"policy:1:update:p{args.kill_prob}:kill"})
        records = [json.loads(line) for line in (Path(tmp) / "soak" / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if "reward/mean" in r]
        restarts = [r for r in records if r.get("event") == "restart"]
        ok = code == 0 and steps == list(range(1, args.steps + 1))
        print(f"exit {code}; {len(steps)} steps recorded, {len(set(steps))} distinct, every step once: {ok}; "
              f"{len(restarts)} restarts; {took:.0f} s")
        if args.baseline:
            _, plain, _ = run(model, Path(tmp) / "plain", args.steps, {})
            per = (took - plain) / max(1, len(restarts))
            print(f"never killed: {plain:.0f} s; a restart cost {per:.0f} s on average")
        if not ok:
            print(out[-3000:])
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
