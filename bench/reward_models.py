"""Reward models on CPU: the plan's ``reward`` phase against the measured peak of each process
that scores, and the time of the phase.

    .venv/bin/python bench/reward_models.py            # ~3 min on 2 cores

Two runs of 3 GRPO steps on the tiny policy (glibc's default allocator, ``memory.trim_heap`` on):

- ``ray``: 2 policy ranks and 2 reward-model ranks (Ray actors of their own, FSDP2 over gloo),
  a ``small`` reward model (8 layers, hidden 512: 75 MiB of fp32 weights, sharded over the 2
  ranks) scoring 16 sequences per step; each reward-model rank's ``reward`` phase peak against
  the plan's ``reward_model`` process.
- ``inprocess``: the same in one process (policy, reward model, driver): its ``reward`` phase
  peak against the plan's trainer + driver + rank-0 kinds there.

The figure is the process's peak RSS in the phase of the last step (``mem/<process>/reward/host_peak_gib``).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run(backend: str, tmp: Path, policy: Path, rm: Path) -> dict:
    from rich.console import Console

    from fitrl.report.load import load_run
    from fitrl.trainer.run import train
    from helpers import read_metrics, toy_config

    ray = backend == "ray"
    cfg = toy_config(policy, tmp / backend, "trainer.max_steps=3", "trainer.device=cpu", f"trainer.backend={backend}",
                     f"trainer.devices_per_node={2 if ray else 1}", "data.rollout_batch_size=4", "rollout.n=4",
                     "actor.mini_batch_size=4", "actor.micro_batch_size=4", "trainer.val_before_train=false",
                     "trainer.val_freq=0", "memory.plan=warn", "memory.uss_min_phase_s=0", "memory.phase_peaks=rewind",
                     "reward.sources.rule.weight=1.0", "reward.sources.rm.kind=model",
                     f"reward.sources.rm.model.path={rm}", "reward.sources.rm.weight=0.5",
                     "reward.sources.rm.micro_batch_size=8")
    train(cfg, Console(file=io.StringIO()))
    last = [r for r in read_metrics(tmp / backend) if "reward/mean" in r][-1]
    plan = load_run(tmp / backend).plan
    processes = ["reward_model.rank0", "reward_model.rank1"] if ray else ["rank0"]
    out = {"time_reward_s": round(last["time/reward"], 3)}
    for p in processes:
        measured = last[f"mem/{p}/reward/host_peak_gib"]
        planned = plan.peak(p, "reward", "host")
        out[p] = {"planned_gib": round(planned, 3), "measured_gib": round(measured, 3),
                  "error_pct": round(100 * (planned - measured) / measured, 1)}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["ray", "inprocess"], nargs="*", default=["ray", "inprocess"])
    args = p.parse_args(argv)
    if len(args.only) > 1:  # each run in a process of its own: the in-process run measures its process,
        for backend in args.only:  # which a Ray driver's state before it would add to (-14 % measured)
            subprocess.run([sys.executable, __file__, "--only", backend], check=True)
        return 0
    from fitrl.workers.ray_group import ensure_ray
    from fresh_models import tiny_model_in_child

    tmp = Path(tempfile.mkdtemp(prefix="fitrl-rm-"))
    # built in child processes: here they would count against the in-process run (bench/fresh_models.py)
    policy = tiny_model_in_child(tmp / "policy", size="tiny", seed=0)
    rm = tiny_model_in_child(tmp / "rm", size="small", seed=1, head="reward")
    backend = args.only[0]
    if backend == "ray":
        ensure_ray(num_cpus=2)
    print(backend, json.dumps(run(backend, tmp, policy, rm)), flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
