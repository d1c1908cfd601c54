"""The one container data travels in between roles.

A :class:`Batch` holds per-sample tensors (first dimension = batch) and per-sample Python
fields (lists: prompt text, answers, uids ...), plus batch-level ``meta``. It splits into
micro-batches, concatenates, indexes and moves between devices, so the driver never
handles a loose tensor and a worker group can scatter/gather without knowing the keys.

A set of named per-sample values (the reward's components) travels as one structured entry:
a (B, C) tensor with its C names in ``meta`` (:meth:`Batch.put_named`, :meth:`Batch.named`),
never as string-keyed entries to be parsed back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    fields: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.fields.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch entries disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.fields.values():
            return len(v)
        return 0

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.fields:
            return self.fields[key]
        raise KeyError(f"{key!r} not in batch (tensors: {sorted(self.tensors)}, fields: {sorted(self.fields)})")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.fields

    def keys(self) -> list[str]:
        return [*self.tensors, *self.fields]

    def update(self, other: "Batch | None" = None, **tensors: torch.Tensor) -> "Batch":
        """Add entries in place (same batch size); returns self for chaining."""
        if other is not None:
            if len(other) != len(self) and len(self):
                raise ValueError(f"cannot merge a batch of {len(other)} into one of {len(self)}")
            self.tensors.update(other.tensors)
            self.fields.update(other.fields)
            self.meta.update(other.meta)
        for k, v in tensors.items():
            if len(self) and v.shape[0] != len(self):
                raise ValueError(f"tensor {k!r} has batch size {v.shape[0]}, batch has {len(self)}")
            self.tensors[k] = v
        return self

    def put_named(self, key: str, values: dict[str, torch.Tensor]) -> "Batch":
        """Store named (B,) tensors as one (B, C) entry ``key`` (their promoted dtype), their names
        in ``meta`` (nothing when ``values`` is empty)."""
        if values:
            dtype = functools.reduce(torch.promote_types, (v.dtype for v in values.values()))
            self.update(**{key: torch.stack([v.to(dtype) for v in values.values()], dim=1)})
            self.meta[_names_key(key)] = list(values)
        return self

    def named(self, key: str) -> dict[str, torch.Tensor]:
        """The named (B,) tensors stored by :meth:`put_named` (empty when ``key`` is absent)."""
        if key not in self.tensors:
            return {}
        table = self.tensors[key]
        # contiguous copies: a strided column sums in another order, and means would differ in the last bit
        return {name: table[:, i].contiguous() for i, name in enumerate(self.meta[_names_key(key)])}

    def index(self, idx: Sequence[int] | torch.Tensor | slice) -> "Batch":
        if isinstance(idx, slice):
            return Batch({k: v[idx] for k, v in self.tensors.items()},
                         {k: v[idx] for k, v in self.fields.items()}, dict(self.meta))
        idx_list = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        index_tensor = torch.as_tensor(idx_list, dtype=torch.long)
        return Batch({k: v[index_tensor.to(v.device)] for k, v in self.tensors.items()},
                     {k: [v[i] for i in idx_list] for k, v in self.fields.items()}, dict(self.meta))

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of ``size`` samples (the last may be shorter)."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, parts: int) -> list["Batch"]:
        """``parts`` equal consecutive pieces; the batch must divide evenly (data-parallel scatter)."""
        if len(self) % parts:
            raise ValueError(f"batch of {len(self)} does not split into {parts} equal parts")
        return self.split(len(self) // parts)

    def repeat_interleave(self, n: int) -> "Batch":
        """Each sample repeated ``n`` times in place: [a, b] -> [a, a, b, b] (GRPO groups stay contiguous)."""
        return Batch({k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()},
                     {k: [x for x in v for _ in range(n)] for k, v in self.fields.items()}, dict(self.meta))

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.fields), dict(self.meta))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        batches = [b for b in batches if len(b) or b.keys()]
        if not batches:
            return Batch()
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(f"cannot concat batches with keys {sorted(first.keys())} and {sorted(b.keys())}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        fields = {k: [x for b in batches for x in b.fields[k]] for k in first.fields}
        meta = dict(first.meta)
        for k in first.tensors:
            if _names_key(k) in meta:  # named columns: the union of the names, 0 where a piece has none
                names = list(dict.fromkeys(n for b in batches for n in b.meta[_names_key(k)]))
                if any(b.meta[_names_key(k)] != names for b in batches):
                    tensors[k] = torch.cat([_widened(b, k, names) for b in batches], dim=0)
                meta[_names_key(k)] = names
        return Batch(tensors, fields, meta)


def _names_key(key: str) -> str:
    """Where :meth:`Batch.put_named` keeps the names of entry ``key``'s columns."""
    return f"{key}:names"


def _widened(batch: Batch, key: str, names: list[str]) -> torch.Tensor:
    """``batch``'s named entry ``key`` with a column per name of ``names`` (zeros where it has none)."""
    own = batch.named(key)
    table = batch.tensors[key]
    return torch.stack([own[n] if n in own else table.new_zeros(len(table)) for n in names], dim=1)
