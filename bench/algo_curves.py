"""Reward curves of the algorithm presets on the toy task (same model, seed and step count).

    .venv/bin/python bench/algo_curves.py                         # grpo, dapo, rloo; 150 steps
    .venv/bin/python bench/algo_curves.py --presets grpo ppo --steps 100

Prints, per preset, the mean training reward over each block of 10 steps and the final
validation reward (greedy), plus wall time. Each preset runs in this process one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"grpo": "arith.yaml", "dapo": "arith_dapo.yaml", "rloo": "arith_rloo.yaml", "ppo": "arith_ppo.yaml"}


def run(preset: str, steps: int, model: Path, tmp: str) -> dict:
    from rich.console import Console

    from fitrl.config import load_config
    from fitrl.trainer.run import train

    cfg = load_config(str(ROOT / "examples" / PRESETS[preset]), [
        f"actor.model.path={model}", f"trainer.run_dir={tmp}/{preset}", f"trainer.max_steps={steps}",
        f"data.train_files=[{ROOT / 'examples/data/arith_train.jsonl'}]",
        f"data.val_files=[{ROOT / 'examples/data/arith_val.jsonl'}]", "trainer.val_before_train=false",
        "trainer.progress_bar=false"])
    start = time.perf_counter()
    history = train(cfg, Console(quiet=True))
    rewards = [h["reward/mean"] for h in history]
    blocks = [statistics.fmean(rewards[i:i + 10]) for i in range(0, len(rewards), 10)]
    import json
    val = [json.loads(line) for line in (Path(tmp) / preset / "metrics.jsonl").read_text().splitlines()]
    final_val = [v for v in val if "val/reward/mean" in v][-1]
    return {"preset": preset, "blocks": blocks, "seconds": time.perf_counter() - start,
            "val": final_val["val/reward/mean"], "val_exact": final_val.get("val/reward/exact", float("nan")),
            "rounds": statistics.fmean(h["sampling/rounds"] for h in history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["grpo", "dapo", "rloo"], choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    from fitrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny-qwen2", arch="qwen2", size="tiny", seed=1)
        rows = [run(p, args.steps, model, tmp) for p in args.presets]
    print(f"toy task, tiny qwen2 (seed 1), {args.steps} steps; training reward/mean per 10-step block")
    for r in rows:
        curve = " ".join(f"{b:.2f}" for b in r["blocks"])
        print(f"{r['preset']:>5}: {curve} | final val reward {r['val']:.3f} (exact {r['val_exact']:.2f}) | "
              f"{r['seconds']:.0f}s, {r['rounds']:.2f} generation rounds/step")


if __name__ == "__main__":
    main()
