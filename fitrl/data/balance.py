"""Balancing work by tokens: micro-batches under a (padded) token budget, and equal-count
data-parallel shards with similar token totals. Pure functions over sequence lengths.
"""

from __future__ import annotations

import heapq


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


def micro_batches_by_tokens(lengths: list[int], budget: int, min_count: int = 1,
                            packed: bool = False) -> list[list[int]]:
    """Micro-batches whose *padded* size (sequences x the longest of them, what a forward holds:
    fitrl pads a micro-batch to its longest) stays within ``budget`` tokens, a sequence longer
    than the budget alone; as few as that allows, at least ``min_count`` (e.g. the largest count
    over data-parallel ranks, so every rank runs the same number of backwards) and at most one per
    sequence, with the largest padded size as small as that many allow. Sequences are grouped by
    length (longest first), each group in ascending index order.

    Bounding real tokens instead would let many short sequences and one long one share a
    micro-batch padded to the long one: more than the budget, and more than a plan at the caps.

    >>> micro_batches_by_tokens([10, 50, 12, 48], 100)  # 50+48 padded to 2 x 50; 12+10 to 2 x 12
    [[1, 3], [0, 2]]

    ``packed``: the forwards run each micro-batch padding-free (fitrl/core/packing.py), so its
    size is its packed rows x its longest, and a micro-batch is filled first-fit by that.

    >>> micro_batches_by_tokens([50, 40, 10, 10, 10, 10, 10, 10], 100, packed=True)  # rows 50 | 40+10
    [[0, 1, 2], [3, 4, 5, 6, 7]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    fill = _first_fit_packed if packed else _pack
    count = min(len(lengths), max(min_count, len(fill(order, lengths, budget))))
    # the smallest cap at which filling needs no more than ``count`` micro-batches (never above the
    # budget: a sequence longer than it must not widen the others' micro-batches)
    lo, hi = min(max(lengths, default=0), budget), budget
    while lo < hi:
        mid = (lo + hi) // 2
        if len(fill(order, lengths, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    bins = fill(order, lengths, lo)
    while len(bins) < count:  # fewer than the ranks' count: split the fullest (never raises a cap)
        bins.sort(key=len, reverse=True)
        big = bins.pop(0)
        bins += [big[:len(big) // 2], big[len(big) // 2:]]
    return [sorted(b) for b in sorted(bins, key=lambda b: (-max(lengths[i] for i in b), min(b)))]


def _pack(order: list[int], lengths: list[int], cap: int) -> list[list[int]]:
    """Consecutive runs of ``order`` (longest first) while runs x their first (longest) <= cap."""
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= cap:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def _first_fit_packed(order: list[int], lengths: list[int], cap: int) -> list[list[int]]:
    """Each sequence of ``order`` (longest first) into the first micro-batch whose packed size
    stays within ``cap``: placed first-fit into its rows as wide as its first (longest), or in a
    new row; rows x width is what :func:`fitrl.core.packing.pack_layout` makes of the bin."""
    bins: list[list[int]] = []
    rooms: list[list[int]] = []  # per bin, each row's free tokens
    for i in order:
        n = lengths[i]
        for b, room in enumerate(rooms):
            width = lengths[bins[b][0]]
            r = next((r for r, free in enumerate(room) if n <= free), None)
            if r is not None:
                room[r] -= n
            elif (len(room) + 1) * width <= cap:
                room.append(width - n)
            else:
                continue
            bins[b].append(i)
            break
        else:
            bins.append([i])
            rooms.append([0])  # its first row: as wide as it
    return bins


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
