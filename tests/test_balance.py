import doctest
import random

import pytest
import torch

import fitrl.data.balance as balance
from fitrl.data.balance import balanced_bins, equal_count_shards, micro_batches_by_tokens
from fitrl.data.batch import Batch
from fitrl.workers.group import RoleHandle, WorkerGroup, dispatch


def test_doctests():
    assert doctest.testmod(balance).failed == 0


def test_bins_cover_every_index_once_and_balance():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(37)]
    bins = balanced_bins(lengths, 5)
    assert sorted(i for b in bins for i in b) == list(range(37)) and all(bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first bound


def test_micro_batches_by_tokens_respects_min_count():
    assert len(micro_batches_by_tokens([10] * 8, budget=40)) == 2
    assert len(micro_batches_by_tokens([10] * 8, budget=40, min_count=3)) == 3  # another rank needs 3
    assert len(micro_batches_by_tokens([10] * 4, budget=1)) == 4  # never more than one per sequence
    with pytest.raises(ValueError, match="equal shards"):
        equal_count_shards([1, 2, 3], 2)


def test_equal_count_shards_balance_tokens():
    lengths = [100, 90, 10, 5, 80, 1, 50, 40]
    order = equal_count_shards(lengths, 2)
    assert sorted(order) == list(range(8))
    halves = [sum(lengths[i] for i in order[:4]), sum(lengths[i] for i in order[4:])]
    assert abs(halves[0] - halves[1]) <= 30  # a count split would give 205 vs 171


class Echo:
    def __init__(self, rank):
        self.rank = rank

    @dispatch("dp")
    def tag(self, batch: Batch) -> Batch:
        return Batch({"rank": torch.full((len(batch),), self.rank), "seen": batch["attention_mask"].sum(-1)})


class TwoRanks(WorkerGroup):
    """Two in-process workers: enough to see the data-parallel split and gather."""

    def __init__(self):
        self.worker_cls, self.world_size = Echo, 2
        self.workers = [Echo(0), Echo(1)]

    def call_all(self, method, per_rank_args, kwargs):
        return [getattr(w, method)(*a, **kwargs) for w, a in zip(self.workers, per_rank_args)]


def test_dp_dispatch_balances_tokens_and_restores_order():
    lengths = torch.tensor([9, 8, 1, 1, 7, 2, 1, 1])
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    out = RoleHandle(TwoRanks()).tag(Batch({"attention_mask": mask}))
    assert out["seen"].tolist() == lengths.tolist()  # results come back in the caller's order
    per_rank = [int(lengths[out["rank"] == r].sum()) for r in (0, 1)]
    # 13 vs 17 is the best 4+4 split of these lengths; splitting in order would give 19 vs 11
    assert sorted(out["rank"].tolist()) == [0] * 4 + [1] * 4 and sorted(per_rank) == [13, 17]
