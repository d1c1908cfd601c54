"""On-policy distillation against GRPO on the toy task (docs/algorithms.md, "On-policy
distillation"; figures in bench/RESULTS.md).

Per seed: one supervised warm start of the demo's tiny student (examples/arith_sft.yaml), then
three runs of the same steps from it, differing only in ``algorithm.distill.weight``:

- ``grpo``: 0, GRPO alone (examples/arith_demo.yaml, `fitrl demo`'s run);
- ``distill``: 1, pure distillation: the forward KL from the teacher's top-8 distribution to the
  student's at every position the student sampled (the example's loss), the reward only logged;
- ``both``: 0.5, half of each (examples/arith_distill.yaml, `fitrl demo --distill`'s run).

Other ways to combine the two, run with ``--modes``: ``both-0.9`` (weight 0.9), ``gated``
(weight 0.5, ``algorithm.distill.solved_score=0.9``: a response the reward accepts is left to
GRPO), ``then150`` and ``then300`` (distill, then GRPO: weight 1 falling to 0 over 150 or 300
steps, ``algorithm.distill.decay_steps``).

The teacher (examples/arith_teacher.yaml: the demo's recipe run longer under another seed, so it
shares the student's tokenizer) is made once, when missing, and scored on the same held-out sums.
Validation exact-match accuracy is read from each run's metrics.jsonl at every validation: one
greedy answer per held-out sum (the demo's), or with ``--val-samples N`` the mean over N samples
at temperature 1 (less quantised: 20 sums move a greedy figure by 0.05 an answer).

    .venv/bin/python bench/distill.py --seeds 1 2 3 --parallel 2
    .venv/bin/python bench/distill.py --seeds 1 2 3 --parallel 3 --val-samples 16 --out runs/bench-distill-sampled

Every run is a `fitrl` subprocess with ``trainer.num_threads=1``; ``--parallel`` runs that many
at once. Prints a markdown table per mode and a summary (mean accuracy per validation step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FITRL = [str(Path(sys.executable).parent / "fitrl")]
MODES = {"grpo": ("examples/arith_demo.yaml", []),
         "distill": ("examples/arith_distill.yaml", ["algorithm.distill.weight=1.0"]),
         "both": ("examples/arith_distill.yaml", ["algorithm.distill.weight=0.5"]),
         "gated": ("examples/arith_distill.yaml", ["algorithm.distill.weight=0.5", "algorithm.distill.solved_score=0.9"]),
         "both-0.9": ("examples/arith_distill.yaml", ["algorithm.distill.weight=0.9"]),
         "then150": ("examples/arith_distill.yaml", ["algorithm.distill.weight=1.0", "algorithm.distill.decay_steps=150"]),
         "then300": ("examples/arith_distill.yaml", ["algorithm.distill.weight=1.0", "algorithm.distill.decay_steps=300"])}
TEACHER_DIR = ".cache/models/tiny-teacher-arith"


def fitrl(args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        done = subprocess.run([*FITRL, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"fitrl {' '.join(args)} exited {done.returncode}: see {log}")


def validations(run_dir: Path) -> list[tuple[int, float]]:
    """(step, exact-match accuracy) of every validation of a run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # (a validation's figures are in its own record and again in its step's: one per step)
    return sorted({r["step"]: r["val/reward/exact"] for r in rows if "val/reward/exact" in r}.items())


def make_teacher(out: Path, val: list[str]) -> list[tuple[int, float]]:
    """The teacher at TEACHER_DIR, made when missing as `fitrl demo --distill` makes it (the warm
    start under the teacher config's seed, then its GRPO steps), and its held-out accuracy (a
    validation-only run)."""
    teacher = ROOT / TEACHER_DIR
    if not (teacher / "config.json").is_file():
        warm = warm_start(0, out, name="teacher")
        fitrl(["train", "examples/arith_teacher.yaml", f"actor.model.path={warm}", "trainer.num_threads=1",
               f"trainer.run_dir={out}/teacher/grpo", "checkpoint.resume=never"], out / "teacher" / "grpo.log")
        fitrl(["export", f"{out}/teacher/grpo", str(teacher)], out / "teacher" / "export.log")
    fitrl(["train", "examples/arith_demo.yaml", f"actor.model.path={teacher}", "trainer.val_only=true", *val,
           "trainer.num_threads=1", f"trainer.run_dir={out}/teacher/val", "checkpoint.resume=never"],
          out / "teacher" / "val.log")
    return validations(out / "teacher" / "val")


def warm_start(seed: int, out: Path, name: str = "") -> Path:
    """The supervised warm start of the demo's tiny model under ``seed``, exported (a student's is
    shared by its three modes)."""
    seed_dir = out / (name or f"seed{seed}")
    warm = seed_dir / "warm-hf"
    if not (warm / "config.json").is_file():
        fitrl(["sft", "examples/arith_sft.yaml", f"trainer.seed={seed}", "trainer.num_threads=1",
               f"trainer.run_dir={seed_dir}/warm"], seed_dir / "warm.log")
        fitrl(["export", f"{seed_dir}/warm", str(warm)], seed_dir / "warm-export.log")
    return warm


def run_mode(seed: int, mode: str, out: Path, steps: int | None, val: list[str]) -> list[tuple[int, float]]:
    """One mode's run from the seed's warm start (a finished run is read, not run again)."""
    seed_dir = out / f"seed{seed}"
    run_dir = seed_dir / mode
    config, overrides = MODES[mode]
    if not (run_dir / "metrics.jsonl").is_file() or not validations(run_dir):
        extra = [f"trainer.max_steps={steps}"] if steps else []
        extra += val
        fitrl(["train", config, *overrides, f"actor.model.path={seed_dir / 'warm-hf'}", f"trainer.seed={seed}",
               "trainer.num_threads=1", f"trainer.run_dir={run_dir}", "checkpoint.resume=never", *extra],
              seed_dir / f"{mode}.log")
    return validations(run_dir)


def table(results: dict[int, dict[str, list[tuple[int, float]]]]) -> str:
    steps = [s for s, _ in next(iter(next(iter(results.values())).values()))]
    head = "| seed | mode | " + " | ".join(f"step {s}" for s in steps) + " |"
    lines = [head, "|" + "---|" * (len(steps) + 2)]
    for seed, curves in sorted(results.items()):
        for mode, curve in curves.items():
            lines.append(f"| {seed} | {mode} | " + " | ".join(f"{a:.2f}" for _, a in curve) + " |")
    lines.append("")
    lines.append("| mode | " + " | ".join(f"mean at step {s}" for s in steps) + " |")
    lines.append("|" + "---|" * (len(steps) + 1))
    for mode in next(iter(results.values())):
        means = [sum(r[mode][i][1] for r in results.values()) / len(results) for i in range(len(steps))]
        lines.append(f"| {mode} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--parallel", type=int, default=2, help="runs at once (each one thread)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the demo's 300)")
    p.add_argument("--out", default="runs/bench-distill", help="where the runs go (reused: a finished run is read)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["grpo", "distill", "both"])
    p.add_argument("--val-samples", type=int, default=0,
                   help="validate on that many samples per held-out sum at temperature 1 (the mean accuracy of the "
                        "policy's samples) instead of one greedy answer each (the demo's)")
    args = p.parse_args()
    val = [f"rollout.val.n={args.val_samples}", "rollout.val.temperature=1.0"] if args.val_samples else []
    out = (ROOT / args.out).resolve()
    teacher = make_teacher(out, val)
    print(f"teacher ({TEACHER_DIR}): held-out exact-match accuracy {teacher[-1][1]:.2f}")
    runs = [(seed, mode) for seed in args.seeds for mode in args.modes]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(lambda s: warm_start(s, out), args.seeds))
        curves = list(pool.map(lambda r: run_mode(*r, out, args.steps, val), runs))
    results: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for (seed, mode), curve in zip(runs, curves):
        results.setdefault(seed, {})[mode] = curve
    print(table(results))


if __name__ == "__main__":
    main()
