"""How a pushed tensor crosses to vLLM's TP worker processes (the ``workers`` layout,
fitrl/rollout/vllm_engine.py, ``_push_in_buckets``): a host tensor on CPU, as today; on CUDA a CUDA
IPC handle of the device tensor itself (torch's ``reduce_tensor``, as sglang's and veRL's pushes),
so no bucket is staged in host memory and each worker reads the trainer's device copy to shard it.

The handle is valid while the trainer keeps the tensor: ``collective_rpc`` returns once every worker
has loaded its bucket, so a bucket is held until then. The TP workers inherit the trainer process's
``CUDA_VISIBLE_DEVICES`` (vLLM's multiprocess executor), so the handle's device index names the
same GPU on both sides; opening it on another GPU needs peer access between the two (NVLink/PCIe
P2P), which only a GPU node can confirm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class CudaIpcTensor:
    """A device tensor of another process, as torch's ``reduce_tensor`` describes it: a rebuild
    function (pickled by reference) and its arguments (the IPC handle, shape, dtype, device)."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple

    def open(self) -> torch.Tensor:
        return self.rebuild(*self.args)


def to_wire(tensor: torch.Tensor) -> torch.Tensor | CudaIpcTensor:
    """What a push hands the TP workers for ``tensor``: an IPC handle of a device tensor (no copy),
    a host tensor as it is (pickled out of band by vLLM's message queue)."""
    if tensor.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return CudaIpcTensor(*reduce_tensor(tensor.detach().contiguous()))
    return tensor.detach().cpu()


def from_wire(value: torch.Tensor | CudaIpcTensor) -> torch.Tensor:
    """A TP worker's view of what :func:`to_wire` sent."""
    return value.open() if isinstance(value, CudaIpcTensor) else value
