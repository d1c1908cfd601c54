"""Padding-free layout of a micro-batch: its sequences packed end to end into a few rows.

A micro-batch in the padded layout (:mod:`fitrl.core.padding`) is (B, T): every row as wide as
the widest prompt plus the widest response, so a batch of one long and seven short sequences runs
8 x T positions through every layer. Packed, the same tokens sit end to end in rows of width
W = the longest sequence (first-fit decreasing), each sequence's positions restarting at 0. A
model's own forward reads the restarts as sequence boundaries (transformers' packed-sequence
masks for SDPA and eager attention, ``cu_seqlens`` for flash-attention varlen), so every token
attends to exactly the tokens it attends to padded: the same log-probs to rounding.

Rows x W never exceeds B x T (no row is wider than T, never more rows than sequences), so the
linear layers' work and the attention's per-row squares only shrink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices of sequences per row, each row's total within ``width``
    (a longer sequence alone), longest first; each row in the order its sequences were placed.

    >>> pack_rows([5, 1, 4, 2, 3], 6)  # 5+1, 4+2, 3
    [[0, 1], [2, 3], [4]]
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def packed_size(lengths: list[int]) -> int:
    """Positions a packed forward of these sequences runs: rows x the longest."""
    if not lengths:
        return 0
    width = max(lengths)
    return len(pack_rows(lengths, width)) * width


@dataclass(frozen=True)
class PackedLayout:
    """Where each real token of a padded (B, T) micro-batch sits in its packed (rows, W) form.

    ``source`` (rows, W): the flat index into the padded (B * T) tensors of each packed slot, a
    slot after a row's last sequence pointing at a padding position (its value is never read
    where it matters: the slot is its own sequence, see :func:`packed_positions`). ``target``
    (B, T): each padded position's flat index into the packed (rows * W), -1 for padding.
    ``filler`` (rows, W) bool: the slots after a row's sequences.
    """
    source: torch.Tensor
    target: torch.Tensor
    filler: torch.Tensor
    single: bool = False  # every row holds at most one sequence (then filler): plain causal attention is exact

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.source.shape)

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (rows, W): a padded tensor's values in the packed slots."""
        return padded.reshape(-1)[self.source]


def pack_layout(attention_mask: torch.Tensor, multiple: int = 1, one_per_row: bool = False) -> PackedLayout:
    """The packed layout of a padded micro-batch whose rows each hold one contiguous run of real
    tokens (a left-padded prompt then a right-padded response). One host sync (the lengths).
    ``multiple``: the packed width rounded up to a multiple of it (filler at the rows' ends), so
    a sequence-parallel group splits every row in equal chunks. ``one_per_row``: each sequence
    in a row of its own (padding moved to the rows' ends: attention stays plain causal)."""
    B, T = attention_mask.shape
    device = attention_mask.device
    mask = attention_mask.bool()
    lengths = mask.sum(-1).tolist()
    starts = mask.long().argmax(-1).tolist()  # each row's first real column
    ends = (T - mask.flip(-1).long().argmax(-1)).tolist()
    for i, (n, a, b) in enumerate(zip(lengths, starts, ends)):
        if n and b - a != n:
            raise ValueError(f"row {i} of the micro-batch has padding between its tokens; packing needs one run per row")
    width = max(max(lengths, default=0), 1)
    rows = [[i] for i in range(B)] if one_per_row else pack_rows(lengths, width)
    used = max(sum(lengths[i] for i in row) for row in rows) if rows else 1
    used = -(-used // multiple) * multiple
    source = torch.empty((len(rows), used), dtype=torch.long)
    filler = torch.zeros((len(rows), used), dtype=torch.bool)
    target = torch.full((B * T,), -1, dtype=torch.long)
    pad_slot = int((~mask).reshape(-1).nonzero()[0]) if (~mask).any() else 0
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            flat = torch.arange(i * T + starts[i], i * T + starts[i] + n)
            source[r, at:at + n] = flat
            target[flat] = torch.arange(r * used + at, r * used + at + n)
            at += n
        source[r, at:] = pad_slot
        filler[r, at:] = True
    return PackedLayout(source.to(device), target.view(B, T).to(device), filler.to(device),
                        single=all(len(row) == 1 for row in rows))


def packed_positions(layout: PackedLayout, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) padded positions -> (rows, W) packed ones. Real tokens keep theirs (0 at each
    sequence's start: the restart that marks a boundary); a row's filler slots count 0, 1, ... as
    a sequence of their own, so no real token attends to them, nor they to it."""
    fill_rank = layout.filler.long().cumsum(-1) - 1  # 0, 1, ... within each row's filler
    return torch.where(layout.filler, fill_rank, layout.gather(position_ids))
