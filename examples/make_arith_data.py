"""Writes the toy arithmetic task: ``What is a + b?`` for single digits, 80 train / 20 val.

Run: python examples/make_arith_data.py  (the files it writes are committed; this documents them)
"""

import json
import random
from pathlib import Path

PHRASING = "What is {a} + {b}? Answer with a number."


def main(out_dir: Path = Path(__file__).parent / "data", seed: int = 0) -> None:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    splits = {"arith_train.jsonl": pairs[:80], "arith_val.jsonl": pairs[80:]}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with open(out_dir / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": PHRASING.format(a=a, b=b), "answer": a + b}) + "\n")


if __name__ == "__main__":
    main()
