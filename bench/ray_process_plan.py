"""Plan against telemetry per process of a 2-rank Ray run (issue 38's held-out check): a bf16
FSDP2 policy (``actor.fsdp.mixed_precision``) with a KL reference of its own ranks, the arith
task, four steps; per process and phase the planned host peak (plan.json, as ``fitrl report``
reads it) and the measured one (``mem/<process>/<phase>/host_peak_gib``, the largest of steps
2-4, ``memory.phase_peaks=rewind``: exact per phase).

    .venv/bin/python bench/ray_process_plan.py                  # the 32M "small" model, ~3 min
    .venv/bin/python bench/ray_process_plan.py --size medium --set memory.plan=warn
    .venv/bin/python bench/ray_process_plan.py --config examples/arith_ppo.yaml --set critic.warmup_steps=0

The model is built in a child process (bench/fresh_models.py) and the plan read at the run's
expected lengths (plan.json keeps both).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="the tiny qwen2 model's size (fitrl.models.tiny.SIZES)")
    p.add_argument("--config", default="examples/arith.yaml", help="the run's config (examples/arith_ppo.yaml: a critic)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = p.parse_args()
    from rich.console import Console

    from fitrl.config import load_config
    from fresh_models import tiny_model_in_child
    from fitrl.report.load import load_run
    from fitrl.trainer.run import train

    with tempfile.TemporaryDirectory() as tmp:
        # built in a child process: here it would count against the driver (bench/fresh_models.py)
        model = tiny_model_in_child(Path(tmp) / "model", arch="qwen2", size=args.size, seed=0)
        run = Path(tmp) / "run"
        cfg = load_config(str(ROOT / args.config), [
            f"actor.model.path={model}", f"trainer.run_dir={run}", "trainer.backend=ray", "trainer.devices_per_node=2",
            "trainer.max_steps=4", "trainer.val_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "checkpoint.save_final=false", "algorithm.use_kl_loss=true",
            "actor.fsdp.mixed_precision=true", "ref.fsdp.mixed_precision=true", "memory.phase_peaks=rewind",
            "memory.plan=warn", *args.set])
        train(cfg, Console(file=io.StringIO()))
        steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
        plan = load_run(run).plan
        print(f"{args.config}, qwen2 {args.size}, 2 Ray ranks per role, bf16 FSDP2 policy + KL reference, steps 2-4"
              + (f"; {' '.join(args.set)}" if args.set else ""))
        print(f"{'process':<14} {'phase':<12} {'plan GiB':>9} {'measured':>9} {'error':>7}")
        for key in sorted(steps[-1]):
            if key.count("/") != 3 or not key.endswith("/host_peak_gib"):
                continue
            _, process, phase, _ = key.split("/")
            planned = plan.peak(process, phase, "host") if plan is not None else None
            measured = max(s.get(key, 0.0) for s in steps[1:])
            if planned:
                print(f"{process:<14} {phase:<12} {planned:>9.3f} {measured:>9.3f} {(planned - measured) / measured:>+7.1%}")


if __name__ == "__main__":
    main()
