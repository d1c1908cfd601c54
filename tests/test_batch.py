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


def test_named_values_travel_as_one_structured_entry():
    """Reward components: one (B, C) entry with its names, kept through index, split and concat."""
    b = Batch({"x": torch.arange(4.0)}).put_named("comps", {"exact": torch.tensor([1.0, 0.0, 1.0, 0.0]),
                                                         "format": torch.tensor([1, 1, 0, 1])})
    assert b["comps"].shape == (4, 2) and b["comps"].dtype == torch.float32
    assert list(b.named("comps")) == ["exact", "format"]
    picked = b.index([2, 3]).named("comps")
    assert picked["exact"].tolist() == [1.0, 0.0] and picked["format"].tolist() == [0.0, 1.0]
    joined = Batch.concat(b.split(3))
    assert torch.equal(joined.named("comps")["format"], torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert Batch({"x": torch.zeros(2)}).put_named("comps", {}).named("comps") == {}
    # pieces scored with other components (a reward routed by source): the union, 0 where absent
    other = Batch({"x": torch.zeros(1)}).put_named("comps", {"exact": torch.ones(1), "len": torch.full((1,), 3.0)})
    both = Batch.concat([b, other]).named("comps")
    assert list(both) == ["exact", "format", "len"]
    assert both["len"].tolist() == [0.0] * 4 + [3.0] and both["format"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
