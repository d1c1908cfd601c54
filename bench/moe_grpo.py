"""The tiny Qwen3-MoE on the toy task, seed by seed: a supervised warm start, then GRPO, judged as
`fitrl demo` judges the dense model (fitrl/trainer/verdict.py).

    nice .venv/bin/python bench/moe_grpo.py 1 2 3                 # the seeds, one after another
    nice .venv/bin/python bench/moe_grpo.py 3 --out runs/moe-s3 actor.optim.lr=5e-4   # GRPO overrides

Makes the model when missing (``actor.model.path`` of examples/arith_moe.yaml, as ``fitrl
make-tiny-model --arch qwen3_moe`` would, seed 1), then for each seed runs ``fitrl sft
examples/arith_moe_sft.yaml``, ``fitrl export`` and ``fitrl train examples/arith_moe.yaml`` from that
export, each with ``trainer.seed`` and ``trainer.num_threads=1``, in ``<out>/seed<s>-sft`` and
``<out>/seed<s>`` (their logs beside them, ``<dir>.log``). Prints one markdown row per seed as it
ends, then the table: validation exact-match accuracy at the start of GRPO (the warm start's), at
its end and at every validation; the verdict (``accuracy_gain`` over the held-out prompts,
``collapsed``); the training reward's first and last 10 steps (``judge_rise``); and the last step's
``moe/*`` metrics and router loss. Exits 1 when a seed's accuracy did not rise or its policy
collapsed. Several invocations may run at once (the model is made under a lock).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRPO, WARM = "examples/arith_moe.yaml", "examples/arith_moe_sft.yaml"
MODEL_SEED = 1  # the seed `fitrl demo` makes its model with (trainer.seed's default)
COLUMNS = ["seed", "warm start", "after GRPO", "validation at each step", "verdict",
           "reward first 10 → last 10 (2 se)", "moe/expert_load_entropy", "moe/max_expert_share",
           "moe/routing_mismatch", "actor/router_aux_loss"]


def fitrl(*args: str, log: Path) -> None:
    """One `fitrl` command (the CLI beside this interpreter) from the repository root, its output
    to ``log``; a failure ends the script with the log's tail."""
    cmd = [str(Path(sys.executable).parent / "fitrl"), *args]
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        sys.exit(f"{' '.join(args[:2])} failed (exit status {done.returncode}); {log}:\n{tail}")


def make_model(path: Path) -> None:
    """The tiny MoE at ``path`` unless it is there (one maker at a time across invocations)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            from fitrl.models.tiny import make_tiny_model

            print(f"making the tiny qwen3_moe model in {path} (seed {MODEL_SEED})", flush=True)
            make_tiny_model(path, arch="qwen3_moe", size="tiny", seed=MODEL_SEED)


def run_seed(seed: int, out: Path, model: Path, overrides: list[str], warm_steps: int | None) -> dict:
    """Warm start, export and GRPO for one seed; its row's figures."""
    common = [f"trainer.seed={seed}", "trainer.num_threads=1", "trainer.progress_bar=false"]
    warm, grpo = out / f"seed{seed}-sft", out / f"seed{seed}"
    start = time.perf_counter()
    budget = [f"trainer.max_steps={warm_steps}"] if warm_steps is not None else []
    fitrl("sft", WARM, *common, *budget, f"actor.model.path={model}", f"trainer.run_dir={warm}",
          log=warm.with_suffix(".log"))
    fitrl("export", str(warm), str(warm / "hf"), log=out / f"seed{seed}-export.log")
    fitrl("train", GRPO, *common, f"actor.model.path={warm / 'hf'}", f"trainer.run_dir={grpo}", *overrides,
          log=grpo.with_suffix(".log"))
    return judge(seed, grpo, time.perf_counter() - start)


def judge(seed: int, run: Path, seconds: float) -> dict:
    """The seed's figures from its GRPO run's metrics.jsonl and config.yaml."""
    import yaml

    from fitrl.trainer.verdict import accuracy_gain, collapsed, judge_rise

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r and "event" not in r]
    # a validation's own records (a step's record may carry the validation run before it too)
    vals = [r for r in records if "val/reward/exact" in r and "reward/mean" not in r]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    prompts = sum(1 for f in cfg["data"]["val_files"] for line in (ROOT / f).read_text().splitlines() if line.strip())
    gain = accuracy_gain(run / "metrics.jsonl", prompts=prompts)
    collapse = collapsed(steps, cfg["rollout"]["max_response_length"])
    rewards = [r["reward/mean"] for r in steps]
    rise = judge_rise(rewards)
    before, after = gain["before"], gain["after"]
    if after > before:
        se = ((before * (1 - before) + after * (1 - after)) / prompts) ** 0.5  # (accuracy_gain's noise)
        verdict = (f"rose {'beyond' if gain['beyond_noise'] else 'within'} noise "
                   f"(+{after - before:.2f}, 2 se {2 * se:.2f})")
    else:
        verdict = f"did NOT rise ({after - before:+.2f})"
    if collapse:
        verdict += f"; collapsed: {collapse}"
    last = steps[-1]
    return {"seed": seed, "before": before, "after": after, "vals": [v["val/reward/exact"] for v in vals],
            "val_steps": [v["step"] for v in vals], "verdict": verdict, "ok": after > before and not collapse,
            "reward": f"{sum(rewards[:10]) / 10:.3f} → {sum(rewards[-10:]) / 10:.3f} "
                      f"({2 * rise.get('se', float('nan')):.3f}{'' if rise.get('rose') else ', not beyond noise'})",
            "moe": {k: last.get(k) for k in COLUMNS[6:]}, "seconds": seconds, "steps": last["step"]}


def row(r: dict) -> str:
    moe = [f"{v:.3f}" if v is not None else "-" for v in r["moe"].values()]
    return "| " + " | ".join([str(r["seed"]), f"{r['before']:.2f}", f"{r['after']:.2f}",
                              " ".join(f"{v:.2f}" for v in r["vals"]), r["verdict"], r["reward"], *moe]) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="+", metavar="SEED_OR_OVERRIDE",
                        help="the seeds (integers), then any dotted overrides of GRPO (examples/arith_moe.yaml)")
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help="supervised steps (default: examples/arith_moe_sft.yaml's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the runs go (default runs/moe-grpo-<timestamp>); a seed's directories must be new")
    args = parser.parse_intermixed_args()
    seeds = [int(a) for a in args.args if a.isdigit()]
    overrides = [a for a in args.args if not a.isdigit()]
    bad = [a for a in overrides if "=" not in a]
    if not seeds or bad:
        print(f"bench/moe_grpo.py: give seeds (integers) and overrides (key=value); got {bad or 'no seed'}",
              file=sys.stderr)
        return 2
    out = (args.out or ROOT / "runs" / time.strftime("moe-grpo-%Y%m%d-%H%M%S")).resolve()
    taken = [s for s in seeds if (out / f"seed{s}").exists() or (out / f"seed{s}-sft").exists()]
    if taken:
        print(f"bench/moe_grpo.py: {out} already has runs of seed(s) {taken}: give another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    from fitrl.config import load_config

    model = ROOT / load_config(str(ROOT / GRPO), []).actor.model.path
    make_model(model)
    header = "| " + " | ".join(COLUMNS) + " |\n|" + "---:|" * 3 + "---|" * 3 + "---:|" * 4
    rows = []
    for seed in seeds:
        r = run_seed(seed, out, model, overrides, args.warm_start_steps)
        rows.append(r)
        print(f"seed {seed}: {r['steps']} GRPO steps, {r['seconds'] / 60:.1f} min (both stages); "
              f"validation at steps {' '.join(map(str, r['val_steps']))}", flush=True)
        print(row(r), flush=True)
    print(f"\ntiny Qwen3-MoE GRPO on the toy task ({' '.join([GRPO, *overrides])}); runs in {out}\n")
    print(header)
    for r in rows:
        print(row(r))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
