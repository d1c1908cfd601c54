"""Host memory of every process kind a CPU run starts, beside its model state: the Ray role
actors (policy, reference, critic ranks), the driver, Ray's own processes and the reward workers.
The planner's per-process runtimes (fitrl/memory/calibration.py) come from here.

    .venv/bin/python bench/process_memory.py            # ~3 min on 2 cores

Roles: a two-step PPO run with a KL loss (``examples/arith_ppo.yaml``: policy, reference and
critic groups of 2 ranks each, ``trainer.backend=ray``) on the tiny model (0.6 MiB of weights, so
what a process holds is its runtime); the ranks' telemetry (``mem/<role>.rank<i>/<phase>``) gives
each process's RSS and USS at the end of its phases of step 2. Ray's processes (raylet, GCS,
log monitor, idle workers) are read with psutil while the run's cluster is still up. Reward
workers: a ``RewardPool`` of 2 workers per built-in function, after one call each.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
GIB = 1024**3


def _mem(p: psutil.Process) -> dict:
    full = p.memory_full_info()
    return {"rss_gib": full.rss / GIB, "uss_gib": full.uss / GIB, "pss_gib": getattr(full, "pss", 0) / GIB}


def roles() -> dict:
    from rich.console import Console

    from fitrl.config import load_config
    from fitrl.models.tiny import make_tiny_model
    from fitrl.trainer.run import train
    from fitrl.workers.ray_group import ensure_ray
    from helpers import DATA, read_metrics

    tmp = Path(tempfile.mkdtemp(prefix="fitrl-procmem-"))
    model = make_tiny_model(tmp / "tiny-qwen2", arch="qwen2", size="tiny", seed=0)
    cfg = load_config(str(ROOT / "examples" / "arith_ppo.yaml"), [
        f"actor.model.path={model}", f"trainer.run_dir={tmp / 'run'}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]",
        "data.val_files=[]", "trainer.progress_bar=false", "memory.plan=off", "memory.uss_min_phase_s=0", "memory.phase_peaks=rewind",
        "trainer.max_steps=2", "critic.warmup_steps=0", "algorithm.use_kl_loss=true", "trainer.device=cpu",
        "trainer.backend=ray", "trainer.devices_per_node=2", "data.rollout_batch_size=4", "rollout.n=2",
        "actor.mini_batch_size=4", "critic.mini_batch_size=4", "actor.micro_batch_size=2", "critic.micro_batch_size=2",
        "algorithm.fold_old_logprob=false"])
    ensure_ray(num_cpus=2)
    train(cfg, Console(file=io.StringIO()))
    rec = [r for r in read_metrics(tmp / "run") if "reward/mean" in r][-1]
    out: dict = {}
    for key, value in sorted(rec.items()):
        if key.startswith("mem/") and key.endswith(("/host_rss_gib", "/host_uss_gib", "/host_peak_gib")):
            out[key] = round(value, 4)
    me = psutil.Process()
    out["ray_processes"] = {}
    for p in me.children(recursive=True):
        try:  # the role actors are gone (killed at shutdown); Ray's own processes stay up
            out["ray_processes"][f"{p.pid} {' '.join(p.cmdline())[:60]}"] = _mem(p)
        except psutil.Error:
            pass
    out["driver_now"] = _mem(me)
    import ray

    ray.shutdown()
    return out


def reward_workers() -> dict:
    from fitrl.rewards.pool import RewardPool

    out = {}
    for fn, args in (("arith", ("42", "42")), ("math", ("\\boxed{2}", "2"))):
        pool = RewardPool(fn, {}, batched=False, num_workers=2, timeout=60)
        pool.run([(args, {})] * 4)
        out[fn] = [_mem(psutil.Process(w.proc.pid)) for w in pool._workers]
        pool.close()
    return out


if __name__ == "__main__":
    result = {"reward_workers": reward_workers(), "roles": roles()}
    print(json.dumps(result, indent=1))
