"""Process-group set-up shared by the worker backends: where a rank sits and how it joins.

Every rank of a role joins one ``torch.distributed`` process group before its worker is built,
so the worker (FSDP2, collectives) finds the usual environment::

    RANK, WORLD_SIZE          global rank and size
    LOCAL_RANK, LOCAL_WORLD_SIZE   rank and size on this node (ranks are numbered node by node)
    MASTER_ADDR, MASTER_PORT  rank 0's node and a port free there (TCPStore rendezvous)

Backend: gloo on CPU; on GPU ``cpu:gloo,cuda:nccl`` (as torchtitan and veRL), NCCL for device
tensors and gloo for host ones, which CPU offload puts into collectives (FSDP2's host shards in
the rank-0 broadcast, in gradient clipping and in a weight push's ``full_tensor()``); NCCL alone
fails there with "No backend type associated with device type cpu". The device is set from the
local rank before the group exists, so NCCL binds the right GPU.

A dead worker raises :class:`fitrl.core.errors.WorkerFailed` (defined on the ground floor).
"""

from __future__ import annotations

# Import-light on purpose: no torch (and no ray) at module level. The driver side of a worker
# group (fitrl.workers.ray_group, reached from the CLI's ``train``) only describes ranks and picks
# ports with this module, without wanting torch; torch is imported inside init_distributed, which
# runs on the ranks.
import os
import random
import socket
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DistEnv:
    """Where one rank sits in its process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size <= self.world_size:
            raise ValueError(f"local rank {self.local_rank} / local world size {self.local_world_size} "
                             f"inconsistent with world size {self.world_size}")

    @classmethod
    def single(cls) -> "DistEnv":
        """World size 1 on this machine (an in-process worker that wants a process group)."""
        return cls(0, 1, 0, 1, "127.0.0.1", free_port())

    def environ(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


# Rendezvous ports are drawn between Ray's worker ports (10002-19999 by default) and the kernel's
# ephemeral range (Linux: from 32768): a port the OS hands out for port 0 can be handed to any
# other socket (a Ray worker's gRPC server, an outgoing connection) between the probe and rank 0's
# bind, which CI saw as EADDRINUSE and as a peer talking to a stranger's server.
RENDEZVOUS_PORTS = (20000, 32768)


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port() -> int:
    """A TCP port free on this host right now, outside the kernel's ephemeral range (see
    RENDEZVOUS_PORTS). Drawn from the system's entropy, not ``random``: seeded processes started
    together must not draw the same port. It is released before use, so another process could
    still take it; fitrl.workers.ray_group retries a rendezvous that finds it taken."""
    low, high = RENDEZVOUS_PORTS[0], min(RENDEZVOUS_PORTS[1], _ephemeral_low())
    draw = random.SystemRandom()
    for _ in range(64 if high - low > 100 else 0):
        port = draw.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a narrow or full range: the OS's pick
        s.bind(("", 0))
        return s.getsockname()[1]


def is_port_taken(error: BaseException) -> bool:
    """A rendezvous that failed because its port was taken (TCPStore's EADDRINUSE)."""
    text = str(error)
    return "EADDRINUSE" in text or "ddress already in use" in text


GPU_BACKEND = "cpu:gloo,cuda:nccl"
"""A GPU group's backend: NCCL for CUDA tensors, gloo for host tensors (CPU offload)."""


def default_backend(use_gpu: bool) -> str:
    return GPU_BACKEND if use_gpu else "gloo"


def backend_for_device(backend: str) -> dict[str, str]:
    """Which backend serves each device type, as ``init_process_group`` reads ``backend``:
    ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; a plain name serves the
    device types it supports (``"gloo"``: cpu and cuda, ``"nccl"``: cuda only).

    >>> backend_for_device("cpu:gloo,cuda:nccl")
    {'cpu': 'gloo', 'cuda': 'nccl'}
    >>> backend_for_device("nccl")
    {'cuda': 'nccl'}
    """
    if ":" not in backend:
        return {device: backend for device in _PLAIN_BACKEND_DEVICES.get(backend, ("cpu", "cuda"))}
    return dict(pair.strip().split(":", 1) for pair in backend.split(","))


_PLAIN_BACKEND_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda")}


def init_distributed(env: DistEnv, backend: str, *, device_index: Optional[int] = None,
                     timeout_s: Optional[float] = None) -> None:
    """Export ``env`` to ``os.environ`` and join the default process group (blocks until every
    rank has joined). With NCCL for CUDA tensors, ``device_index`` (default: the local rank
    modulo the visible devices) becomes the current CUDA device first, and is bound to the group."""
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    os.environ.update(env.environ())
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend_for_device(backend).get("cuda") == "nccl":  # "nccl" or "cpu:gloo,cuda:nccl"
        if not torch.cuda.is_available():
            raise RuntimeError(f"backend {backend!r} needs a CUDA device but none is visible in this process "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        if device_index is None:
            device_index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(device_index)
        kwargs["device_id"] = torch.device("cuda", device_index)
    dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size, **kwargs)
