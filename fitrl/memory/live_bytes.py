"""Peak bytes of the tensor storages an op sequence creates: what the planner's trace reads.

:mod:`fitrl.memory.trace` runs fitrl's step code on fake tensors inside :class:`StorageBytes`.
Each storage an op returns is counted once (views share their base's), from its creation until
it is freed (a weak-reference finalizer), and the peak of the running sum is the phase's
transient. Weights, gradients and buffers exist before the mode is entered and are not counted.

PyTorch's ``MemTracker`` (``torch.distributed._tools``) counts the same storages, and also
attributes them to modules: at every op it walks the modules being run and copies snapshots,
most of a trace's time (8 traces of a 32M-parameter model: 6.8 of 10.4 profiled seconds). Here
an op costs a dictionary lookup. The two agree to within the few kilobytes of input ids and
positions that ``MemTracker`` counts when a module receives them (tests/test_plan_trace.py).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class StorageBytes(TorchDispatchMode):
    """``live``: bytes of the storages created inside the mode and not yet freed; ``peak``: their
    largest sum so far."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def exclude(self, tensors) -> None:
        """Storages that exist already (weights, gradients, buffers): an in-place op returns its
        input, and these must not count as created when it does."""
        for t in tensors:
            self._seen[t.untyped_storage()] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        weakref.finalize(storage, self._free, size)
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, size: int) -> None:
        self.live -= size
