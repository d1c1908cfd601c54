"""What overlapping generation with training buys, from measured per-phase times (issue 41).

    .venv/bin/python bench/async_model.py --run RUN_DIR              # a fitrl run: rollout.mode=sync, rollout.workers>0
    .venv/bin/python bench/async_model.py --published                # veRL's published one-step-off tables

The model. On a split placement (generation on devices or processes of its own, training on
the rest) a synchronous step runs its two sides one after the other, and an overlapped one
(``one_step_off``) runs them side by side:

    sync step         = generation + trainer side
    overlapped step   = max(generation, trainer side)          (+ nothing: the weight send is on the trainer side)
    speed-up          = sync step / overlapped step, at most 2 (the sides equal)

where ``generation`` is the workers' time for one step's rollout and ``trainer side`` everything
the trainer does per step (reward, old log-probs, reference, advantages, update, sending the
weights, the step's bookkeeping). Both are measured on the split placement itself, where they
differ from a colocated run's phases (fewer devices for each side, and decoding is memory-bound,
so its time does not scale with the device count; veRL's 7B run: 4 of 16 GPUs generated in 458 s
what 16 did in 247 s, 1.85x the time for a quarter of the devices). So the model needs one short
run of ``rollout.mode=sync rollout.workers=N`` (``--run``): its ``time/rollout`` medians are the
generation, its other ``time/*`` phases and its wall the trainer side. What the model leaves out:
an async mode's partial rollouts (they smooth the long tail of one generation into the next,
veRL's "fully async", beyond this bound), and the staleness cost to learning (bench/RESULTS.md).

``--published`` applies it to veRL's one-step-off tables (docs/advance/one_step_off.md, volcengine/verl,
file last changed in 2bb42bae6078359c3fdc56ba6c7533e76fc05407): Qwen2.5-Math-7B, DAPO, 2 x 16 H20,
4 GPUs generating and 12 training, seconds per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# veRL one-step-off, async rows (4 generation : 12 training GPUs): generate_sequences, old_log_prob,
# update_actor, the measured step; and the colocated (16 GPU) step they compare with
PUBLISHED = {
    "FSDP2 (response <= 20,480)": {"generation": 458, "trainer": [108, 337], "measured": 520, "colocated": 749},
    "Megatron (response <= 8,192)": {"generation": 501, "trainer": [120, 347], "measured": 566, "colocated": 699},
}

TRAINER_PHASES = ("data", "reward", "old_logprob", "ref", "values", "advantage", "critic_update", "update",
                  "weight_sync")


def overlapped(generation: float, trainer: float) -> float:
    return max(generation, trainer)


def from_run(run_dir: Path, skip: int) -> dict:
    """A sync run with rollout workers: median generation and trainer-side seconds per step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r and "event" not in r][skip:]
    if not steps or "rollout/staleness_max" not in steps[0]:
        raise SystemExit(f"{run_dir}: not a run with rollout workers of their own (rollout.workers)")
    gen = statistics.median(s["time/rollout"] for s in steps)
    trainer = statistics.median(sum(s.get(f"time/{p}", 0.0) for p in TRAINER_PHASES) for s in steps)
    step = statistics.median(s["time/step"] for s in steps)
    return {"generation": gen, "trainer": trainer, "sync step": step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a fitrl run directory (rollout.mode=sync, rollout.workers>0)")
    p.add_argument("--skip", type=int, default=3, help="steps left out at the start")
    p.add_argument("--published", action="store_true")
    args = p.parse_args()
    if args.run:
        m = from_run(args.run, args.skip)
        step = overlapped(m["generation"], m["trainer"])
        print(f"{args.run}: generation {m['generation']:.3f} s, trainer side {m['trainer']:.3f} s, sync step "
              f"{m['sync step']:.3f} s per step -> one_step_off {step:.3f} s, {m['sync step'] / step:.2f}x")
    if args.published:
        print("veRL one-step-off, Qwen2.5-Math-7B DAPO on 16 H20 (4 generating : 12 training), s/step:")
        print(f"{'engine':30} {'gen':>5} {'train':>6} {'model':>6} {'measured':>8} {'model x':>8} {'measured x':>10}")
        for name, row in PUBLISHED.items():
            train = sum(row["trainer"])
            model = overlapped(row["generation"], train)
            print(f"{name:30} {row['generation']:5d} {train:6d} {model:6d} {row['measured']:8d} "
                  f"{row['colocated'] / model:7.2f}x {row['colocated'] / row['measured']:9.2f}x")
    if not (args.run or args.published):
        p.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
