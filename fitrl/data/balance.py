"""Balancing work by tokens: micro-batches under a token budget, and equal-count data-parallel
shards with similar token totals. Pure functions over sequence lengths.
"""

from __future__ import annotations

import heapq
import math


def balanced_bins(lengths: list[int], num_bins: int) -> list[list[int]]:
    """Split indices into ``num_bins`` non-empty groups with similar token totals (longest first
    into the lightest bin). Each group keeps ascending index order.

    >>> balanced_bins([5, 1, 4, 2, 3, 3], 2)  # 5+1+3 = 9 and 4+2+3 = 9
    [[0, 1, 5], [2, 3, 4]]
    """
    if not 1 <= num_bins <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {num_bins} non-empty micro-batches")
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins]


def micro_batches_by_tokens(lengths: list[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """As few micro-batches as keep each near ``budget`` tokens (at least ``min_count``, e.g. the
    largest count over data-parallel ranks, so every rank runs the same number of backwards)."""
    count = max(min_count, math.ceil(sum(lengths) / max(budget, 1)))
    return balanced_bins(lengths, min(count, len(lengths)))


def equal_count_shards(lengths: list[int], parts: int) -> list[int]:
    """A permutation of the indices whose ``parts`` consecutive equal-size chunks have similar token
    totals (each data-parallel rank must get the same number of sequences).

    >>> equal_count_shards([8, 1, 7, 2], 2)
    [0, 1, 2, 3]
    >>> equal_count_shards([8, 7, 2, 1], 2)
    [0, 3, 1, 2]
    """
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} sequences do not split into {parts} equal shards")
    per = len(lengths) // parts
    loads, shards = [0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min((p for p in range(parts) if len(shards[p]) < per), key=lambda p: (loads[p], p))
        shards[b].append(i)
        loads[b] += lengths[i]
    return [i for shard in shards for i in sorted(shard)]
