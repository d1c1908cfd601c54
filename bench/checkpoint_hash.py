"""What checksums cost a checkpoint (fitrl/checkpoint/layout.py): the xxh3-128 of every file, as
``finalize`` computes it at save time and ``read`` (resume, export) and ``fitrl checkpoint verify``
recompute it, against the save itself.

Without an argument it trains the ``small`` tiny model (32M parameters) for one step in a
temporary run directory, so its checkpoint holds the weights and the AdamW moments, as a real
save does; or give a checkpoint directory. The files are read once first: the figure is the
hashing from the page cache, as right after a save; from disk a verification reads at disk speed.

    .venv/bin/python bench/checkpoint_hash.py
    .venv/bin/python bench/checkpoint_hash.py RUN/checkpoints/step_N
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from fitrl.checkpoint import layout

ROOT = Path(__file__).resolve().parent.parent


def small_checkpoint(tmp: Path) -> tuple[Path, float]:
    """A one-step run of the small tiny model; its checkpoint and the save time it printed."""
    import contextlib
    import io

    from fitrl.cli import main
    from fitrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp / "small", arch="qwen2", size="small", seed=0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", str(ROOT / "examples" / "arith.yaml"), f"actor.model.path={model}",
                     f"data.train_files=[{ROOT / 'examples' / 'data' / 'arith_train.jsonl'}]", "data.val_files=[]",
                     f"trainer.run_dir={tmp / 'run'}", "trainer.max_steps=1", "trainer.val_before_train=false",
                     "trainer.progress_bar=false", "memory.plan=off", "reward.num_workers=0",
                     "data.rollout_batch_size=2", "rollout.n=2", "actor.mini_batch_size=2", "actor.micro_batch_size=4"])
    if code != 0:
        raise SystemExit(f"the run failed:\n{out.getvalue()[-3000:]}")
    saved = re.search(r"checkpoint: \S+ \([\d.]+ MiB in ([\d.]+) s\)", out.getvalue())
    return tmp / "run" / "checkpoints" / "step_1", float(saved.group(1)) if saved else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a step_N directory (default: make one, small tiny model)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_s = float("nan")
        path = Path(args.checkpoint) if args.checkpoint else None
        if path is None:
            path, save_s = small_checkpoint(Path(tmp))
        files = sorted(f for f in path.rglob("*") if f.is_file())
        size = sum(f.stat().st_size for f in files)
        for f in files:
            f.read_bytes()  # into the page cache
        best = min(_timed(lambda: [layout.file_hash(f) for f in files]) for _ in range(args.repeat))
        verify = min(_timed(lambda: layout.read(path)) for _ in range(args.repeat))
        print(json.dumps({"checkpoint": str(path), "files": len(files), "MiB": round(size / 2**20, 1),
                          "hash_s": round(best, 3), "hash_MiB_per_s": round(size / 2**20 / best),
                          "read_with_verification_s": round(verify, 3),
                          "save_s": save_s}))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
