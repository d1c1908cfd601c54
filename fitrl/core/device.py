"""``trainer.device`` to a torch device, the same answer for the planner, the driver and every rank.

A rank, and an in-process run's driver, answer from the CUDA this process sees. A Ray run's
driver answers from the cluster (:func:`driving`): its ranks' work is in other processes, on
nodes the head may not share, so it never calls ``torch.cuda`` itself. A call there would make
a CUDA context on GPU 0 (memory the plan does not count, on a GPU a rank uses), a
``synchronize()`` would wait for nothing, and a guard reading device-wide use would judge the
ranks' memory as the driver's; on a head node without GPUs, ``cuda`` would be refused and
``auto`` would put every rank on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import torch

from fitrl.core.bf16_matmul import bf16_matmuls
from fitrl.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GPUFacts:
    """One of the cluster's GPUs, read by a process that holds it."""

    name: str         # torch.cuda.get_device_name
    memory: int       # bytes of one device (total_memory)
    host_memory: int  # bytes of RAM on that GPU's node


@dataclasses.dataclass
class ClusterDevices:
    """What a Ray run's driver knows of its ranks' devices, from the cluster and not from CUDA here.

    ``gpus``: the cluster's ``GPU`` resource; ``probe``: one GPU's :class:`GPUFacts`, read in
    another process (a Ray task holding a GPU), asked at most once and only when needed.
    """

    gpus: int
    probe: Callable[[], GPUFacts]
    _facts: Optional[GPUFacts] = None
    _error: Optional[str] = None

    def facts(self) -> GPUFacts:
        """The probed GPU; raises RuntimeError (the same one each time) when the probe failed."""
        if self._facts is None and self._error is None:
            try:
                self._facts = self.probe()
            except Exception as e:  # (remembered: a second ask would wait as long again)
                self._error = f"{type(e).__name__}: {e}"
        if self._facts is None:
            raise RuntimeError(f"could not read a GPU of the Ray cluster: {self._error}")
        return self._facts


_CLUSTER: Optional[ClusterDevices] = None
"""Set in a Ray run's driver for the run (:func:`driving`); None in ranks and in-process runs."""


@contextlib.contextmanager
def driving(cluster: ClusterDevices) -> Iterator[ClusterDevices]:
    """Within the block this process is the driver of ranks on ``cluster``: devices resolve from
    the cluster, and :func:`cuda_here` is False (no ``torch.cuda`` call from this process)."""
    global _CLUSTER
    previous, _CLUSTER = _CLUSTER, cluster
    try:
        yield cluster
    finally:
        _CLUSTER = previous


def cluster() -> Optional[ClusterDevices]:
    """The cluster this process drives (None: it runs its own device work)."""
    return _CLUSTER


def pick_device(name: str, gpus: int, where: str) -> torch.device:
    """The rule: ``auto`` is CUDA when ``where`` has GPUs (``gpus``), else CPU; ``cuda``
    without GPUs is a config error."""
    if name == "auto":
        return torch.device("cuda" if gpus else "cpu")
    if name == "cuda" and not gpus:
        raise ConfigError(f"trainer.device=cuda but {where} has no CUDA device; use trainer.device=cpu or auto")
    return torch.device(name)


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when this process sees it (a Ray driver: when the cluster has GPUs), else
    CPU. ``cuda`` without CUDA is a config error."""
    if _CLUSTER is not None:
        return pick_device(name, _CLUSTER.gpus, "the Ray cluster")
    if name in ("auto", "cuda"):  # (cpu asks nothing of CUDA)
        return pick_device(name, int(torch.cuda.is_available()), "this process")
    return torch.device(name)


def cuda_here() -> bool:
    """Whether this process may use CUDA: it sees a device and is not a Ray run's driver."""
    return _CLUSTER is None and torch.cuda.is_available()


def cuda_in_use() -> bool:
    """Whether this process has CUDA work of its own to measure, wait for or free: CUDA
    initialised here (a CPU run on a GPU node has none, and asking would make a context)."""
    return cuda_here() and torch.cuda.is_initialized()


def gpu_memory() -> int:
    """Bytes of one of the run's GPUs: CUDA device 0's, or in a Ray driver one cluster GPU's."""
    if _CLUSTER is not None:
        return _CLUSTER.facts().memory
    return torch.cuda.get_device_properties(0).total_memory


def gpu_name(device: torch.device) -> str:
    """The GPU's name (for its datasheet peak): ``device``'s, or in a Ray driver a cluster GPU's
    ("" when the probe failed)."""
    if _CLUSTER is not None:
        try:
            return _CLUSTER.facts().name
        except RuntimeError:
            return ""
    return torch.cuda.get_device_name(device)


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """``dtype`` compute on fp32 weights (``torch.autocast``), nothing when ``dtype`` is None.
    Autocast caches each weight's low-precision copy until the context exits: a context must
    never span an optimizer step (it would compute with the weights from before it). bf16 on a
    CPU without bf16 GEMM kernels also runs its products through fitrl/core/bf16_matmul.py."""
    if dtype is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=dtype))
    stack.enter_context(bf16_matmuls(device, dtype))
    return stack


def low_precision_backward(device: torch.device, dtype: Optional[torch.dtype]):
    """What a backward of a forward run under ``autocast(device, dtype)`` needs around it: the
    bf16 matmul kernels of fitrl/core/bf16_matmul.py on a CPU without its own, else nothing."""
    return bf16_matmuls(device, dtype)
