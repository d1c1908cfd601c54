"""The vision-language toy task (``fitrl demo --vl``): the shapes data generator and the ``choice``
reward. The demo itself runs whole in tests/test_docs.py, against the output docs/vision.md shows."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fitrl.data import toy_images
from fitrl.rewards.choice import choice_reward
from helpers import DATA

SMALL = {"train": {"majority": 6, "count": 3, "compare": 3, "text": 2}}


def _rows(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in jsonl.read_text().splitlines()]


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _colour_pixels(img: np.ndarray, colour: str) -> int:
    return int((img == np.array(toy_images.COLOURS[colour], dtype=np.uint8)).all(-1).sum())


def _shapes(img: np.ndarray) -> int:
    """Shapes in a picture: grid cells holding a pixel that is not background (one shape per cell)."""
    c = toy_images.CELL
    ink = (img != np.array(toy_images.BACKGROUND, dtype=np.uint8)).any(-1)
    return sum(bool(ink[r * c:(r + 1) * c, k * c:(k + 1) * c].any())
               for r in range(toy_images.GRID) for k in range(toy_images.GRID))


def test_shapes_data_is_deterministic_and_the_committed_files_are_its_output(tmp_path):
    a = toy_images.write_shapes_data(tmp_path / "a", seed=0)
    b = toy_images.write_shapes_data(tmp_path / "b", seed=0)
    for split in ("train", "val"):
        committed = DATA / f"shapes_{split}.jsonl"
        assert a[split].read_text() == b[split].read_text() == committed.read_text()
        for row in _rows(committed):   # pixels, not PNG bytes: zlib versions may compress differently
            for name in row["images"]:
                assert np.array_equal(_pixels(tmp_path / "a" / name), _pixels(DATA / name)), name
    other = toy_images.write_shapes_data(tmp_path / "c", seed=1, splits=SMALL)
    assert other["train"].read_text() != toy_images.write_shapes_data(tmp_path / "d", seed=0, splits=SMALL)["train"].read_text()


def test_shapes_answers_match_the_pixels():
    rows = _rows(DATA / "shapes_train.jsonl") + _rows(DATA / "shapes_val.jsonl")
    kinds = {}
    for row in rows:
        kind = row["data_source"].split("/")[1]
        kinds[kind] = kinds.get(kind, 0) + 1
        images = [_pixels(DATA / name) for name in row["images"]]
        assert row["prompt"].count(toy_images.IMAGE) == len(images) and row["answer"] in row["choices"]
        assert all(img.shape == (toy_images.SIZE, toy_images.SIZE, 3) for img in images)
        if kind == "majority":   # equal squares: a colour's pixels are its squares times SQUARE**2
            squares = {c: divmod(_colour_pixels(images[0], c), toy_images.SQUARE ** 2) for c in toy_images.COLOURS}
            assert all(rest == 0 for _, rest in squares.values())
            counts = sorted((n for n, _ in squares.values()), reverse=True)
            assert counts[0] >= 4 and counts[0] - counts[1] >= 3   # a clear winner
            most = max(squares, key=lambda c: squares[c][0])
            assert row["answer"] == "ABCD"[list(toy_images.COLOURS).index(most)]   # (A) red, (B) blue, (C) green, (D) yellow
            assert row["prompt"].split(f"({row['answer']}) ")[1].startswith(most)
            assert _shapes(images[0]) == sum(counts)
        elif kind == "count":
            assert row["answer"] == str(_shapes(images[0]))
        elif kind == "compare":
            first, second = map(_shapes, images)
            assert row["answer"] == ("A" if first > second else "B") and first != second
        else:
            assert kind == "text" and images == []
            option_a = row["prompt"].split("(A) ")[1].split(" or")[0]
            assert (option_a in toy_images.COLOURS) == (row["answer"] == "A")
    # mostly the task the demo is judged on; rows with 0, 1 and 2 images all present
    assert kinds["majority"] > 0.7 * len(rows) and min(kinds.values()) >= 6


@pytest.mark.parametrize("response,answer,choices,score", [
    ("red", "red", ["red", "blue"], 1.0),
    (" Blue. ", "blue", ["red", "blue"], 1.0),   # case, spaces and a trailing full stop do not matter
    ("blue", "red", ["red", "blue"], 0.4),       # a valid option: format credit only
    ("bl", "red", ["red", "blue"], 0.4 * 2 * 2 / 6),
    ("", "red", ["red", "blue"], 0.0),
    ("3", "3", list("1234"), 1.0),
    ("33", "3", list("1234"), 0.4 * 2 / 3),
])
def test_choice_reward_table(response, answer, choices, score):
    assert choice_reward(response, answer, extra={"choices": choices})["score"] == pytest.approx(score, abs=1e-6)


def test_choice_reward_options_from_kwargs_win_and_default_to_the_answer():
    assert choice_reward("blue", "red", choices=["red", "blue"], extra={"choices": ["x"]})["format"] == 1.0
    assert choice_reward("blue", "red")["format"] == pytest.approx(2 * 1 / 7)   # only "red" is an option
