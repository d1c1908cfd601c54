"""The shapes toy task: small pictures of coloured squares and circles drawn with PIL, and
short closed questions about them, for vision-language GRPO on a tiny model (``fitrl demo --vl``,
``examples/shapes_vl.yaml``, scored by the ``choice`` reward).

Four kinds of row, told apart by their ``data_source`` column:

===================  ======  ================================================================  ==========
source               images  prompt                                                            answer
===================  ======  ================================================================  ==========
``shapes/majority``  1       Which colour has the most squares in the picture, (A) red, ...    ``A``..``D``
``shapes/count``     1       How many circles are there? Answer with a digit.                  ``1``..``4``
``shapes/compare``   2       ... Which picture has more circles, (A) the first or (B) the ...  ``A``/``B``
``shapes/text``      0       Which of these is a colour, (A) circle or (B) red? ...            ``A``/``B``
===================  ======  ================================================================  ==========

Every answer is one token of the tiny models' tokenizer (a letter or a digit): a word such as
``blue`` is four of its tokens, and GRPO from random weights then settles on a prefix (``re``,
which earns spelling credit) long before it finds the whole word.

Most rows are ``majority`` (the task the demo is judged on): four options, so a constant guess
is right about a quarter of the time and a policy that reads the pictures has room to show it.
The others exercise rows with no image and with two. Each row also holds its ``choices`` (what the ``choice`` reward gives format
credit for). A picture is a ``SIZE`` x ``SIZE`` white square cut into a ``GRID`` x ``GRID`` grid;
each shape sits in its own cell, jittered, flat-coloured with no anti-aliasing, and all squares
have one size, nearly the cell's (a square is then most of one merged image token, which the tiny
tower tells apart within tens of supervised steps; at 16 px it took hundreds): a colour's pixel count is its number of squares times ``SQUARE**2``, which is how
the tests check the answers. Deterministic for a seed (``random.Random`` seeded by seed and split).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

SIZE = 112  # px: 8 x 8 patches of 14 px, 16 image tokens after the 2 x 2 merge (data.max_pixels=12544)
GRID = 4  # 4 x 4 cells of 28 px: one merged token per cell
CELL = SIZE // GRID
SQUARE = 26  # side of every square, px
CIRCLE = 18  # diameter of every circle, px
BACKGROUND = (255, 255, 255)
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 160, 60), "yellow": (230, 200, 20)}
IMAGE = "<image>"  # data.image_placeholder's default

MAJORITY = ("Which colour has the most squares in the picture, (A) red, (B) blue, (C) green or (D) yellow? "
            "Answer with a letter.")
COUNT = "How many circles are there? Answer with a digit."
COMPARE = ("First picture: {image} Second picture: {image} Which picture has more circles, (A) the first or "
           "(B) the second? Answer with a letter.")
TEXT = "Which of these is a colour, (A) {a} or (B) {b}? Answer with a letter."

SPLITS = {  # rows per source: mostly the majority task, a few of each other kind
    "train": {"majority": 256, "count": 24, "compare": 24, "text": 16},
    "val": {"majority": 34, "count": 2, "compare": 2, "text": 2},
}


def draw_picture(shapes: list[tuple[str, str]], rng: random.Random) -> Image.Image:
    """A picture of ``shapes``, each ``(kind, colour)`` with kind ``square`` or ``circle``, in
    distinct random cells of the grid."""
    if len(shapes) > GRID * GRID:
        raise ValueError(f"{len(shapes)} shapes do not fit in {GRID * GRID} cells")
    img = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for (kind, colour), cell in zip(shapes, rng.sample(range(GRID * GRID), len(shapes))):
        side = SQUARE if kind == "square" else CIRCLE
        x = (cell % GRID) * CELL + rng.randrange(CELL - side + 1)
        y = (cell // GRID) * CELL + rng.randrange(CELL - side + 1)
        box = (x, y, x + side - 1, y + side - 1)  # PIL boxes include both ends: side x side pixels
        if kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.ellipse(box, fill=COLOURS[colour])
    return img


def _majority(rng: random.Random):
    colours = list(COLOURS)
    most = rng.choice(colours)
    # a clear winner (4-6 squares against 0 or 1 of each other colour): a tiny model sees colour
    # area before it counts
    shapes = [("square", most)] * rng.randint(4, 6)
    for colour in colours:
        if colour != most:
            shapes += [("square", colour)] * rng.randint(0, 1)
    rng.shuffle(shapes)
    return IMAGE + MAJORITY, [shapes], "ABCD"[colours.index(most)], list("ABCD")


def _circles(n: int, rng: random.Random) -> list[tuple[str, str]]:
    return [("circle", rng.choice(list(COLOURS))) for _ in range(n)]


def _count(rng: random.Random):
    n = rng.randint(1, 4)
    return IMAGE + COUNT, [_circles(n, rng)], str(n), ["1", "2", "3", "4"]


def _compare(rng: random.Random):
    a, b = rng.sample(range(1, 6), 2)
    while abs(a - b) < 2:
        a, b = rng.sample(range(1, 6), 2)
    return COMPARE.format(image=IMAGE), [_circles(a, rng), _circles(b, rng)], "A" if a > b else "B", ["A", "B"]


def _text(rng: random.Random):
    colour, shape = rng.choice(list(COLOURS)), rng.choice(["circle", "square"])
    first = rng.random() < 0.5
    a, b = (colour, shape) if first else (shape, colour)
    return TEXT.format(a=a, b=b), [], "A" if first else "B", ["A", "B"]


MAKERS = {"majority": _majority, "count": _count, "compare": _compare, "text": _text}


def make_split(split: str, seed: int = 0, sizes: dict[str, int] | None = None
               ) -> list[tuple[dict[str, Any], list[Image.Image]]]:
    """``(row, pictures)`` for every row of one split, shuffled; ``row["images"]`` is filled in by
    :func:`write_shapes_data`. ``sizes``: rows per source (default ``SPLITS[split]``)."""
    rng = random.Random(f"shapes-{seed}-{split}")  # str seeds hash with sha512: stable across runs
    kinds = [k for k, n in (sizes or SPLITS[split]).items() for _ in range(n)]
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        prompt, shapes, answer, choices = MAKERS[kind](rng)
        row = {"prompt": prompt, "answer": answer, "choices": choices, "data_source": f"shapes/{kind}"}
        out.append((row, [draw_picture(s, rng) for s in shapes]))
    return out


def write_shapes_data(out_dir: str | Path, seed: int = 0, splits: dict[str, dict[str, int]] | None = None
                      ) -> dict[str, Path]:
    """Write ``shapes_<split>.jsonl`` and the PNGs under ``shapes/`` in ``out_dir`` (image paths in
    the rows are relative to it: the dataset reads them from the data file's directory).
    Returns ``{split: jsonl path}``."""
    out = Path(out_dir)
    (out / "shapes").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, sizes in (splits or SPLITS).items():
        lines = []
        for i, (row, pictures) in enumerate(make_split(split, seed, sizes)):
            names = [f"shapes/{split}_{i:04d}_{k}.png" for k in range(len(pictures))]
            for name, picture in zip(names, pictures):
                picture.save(out / name, format="PNG", optimize=True)
            lines.append(json.dumps({**row, "images": names}))
        paths[split] = out / f"shapes_{split}.jsonl"
        paths[split].write_text("\n".join(lines) + "\n")
    return paths
