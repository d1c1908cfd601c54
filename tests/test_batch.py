import pytest
import torch

from fitrl.data.batch import Batch


def make(n=4):
    return Batch({"x": torch.arange(n * 2).reshape(n, 2)}, {"s": [f"s{i}" for i in range(n)]}, {"k": 1})


def test_split_concat_roundtrip():
    b = make(5)
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["s"] == b["s"] and back.meta == {"k": 1}


def test_chunk_requires_even_split():
    assert [len(p) for p in make(4).chunk(2)] == [2, 2]
    with pytest.raises(ValueError, match="equal parts"):
        make(5).chunk(2)


def test_repeat_interleave_keeps_groups_contiguous():
    b = make(2).repeat_interleave(3)
    assert b["s"] == ["s0", "s0", "s0", "s1", "s1", "s1"]
    assert b["x"][:, 0].tolist() == [0, 0, 0, 2, 2, 2]


def test_index():
    b = make(4).index([3, 1])
    assert b["s"] == ["s3", "s1"] and b["x"][:, 0].tolist() == [6, 2]


def test_mismatched_sizes_rejected():
    with pytest.raises(ValueError, match="disagree"):
        Batch({"x": torch.zeros(3)}, {"s": ["a"]})
    with pytest.raises(ValueError, match="batch size"):
        make(4).update(y=torch.zeros(3))
    with pytest.raises(KeyError, match="not in batch"):
        make(2)["missing"]
