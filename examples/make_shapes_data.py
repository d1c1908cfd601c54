"""Writes the shapes toy task for vision-language GRPO (examples/shapes_vl.yaml): 320 train /
40 val rows of questions about 112x112 PNG pictures of coloured squares and circles, under
examples/data/ (shapes_train.jsonl, shapes_val.jsonl, shapes/*.png). The rows and pictures are
defined in fitrl/data/toy_images.py, so that `fitrl demo --vl` can write them when missing.

Run: python examples/make_shapes_data.py  (the files it writes are committed; this documents them)
"""

from pathlib import Path

from fitrl.data.toy_images import write_shapes_data


def main(out_dir: Path = Path(__file__).parent / "data", seed: int = 0) -> None:
    for split, path in write_shapes_data(out_dir, seed=seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
