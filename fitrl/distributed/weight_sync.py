"""The weight channel: a process group of its own between the policy's rank 0 and the rollout
workers of their own (``rollout.weight_transport``; docs/async.md), over which each new version of
the weights is broadcast in buckets.

Ranks: 0 is the trainer (the policy's rank 0), 1..N the rollout workers. Each side already has a
default process group of its own (the policy's ranks; each worker alone), so the channel is made
without touching either: a TCPStore rendezvous hosted by the trainer and a directly constructed
backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), used through its own ``broadcast`` rather than
through ``torch.distributed``'s group registry (vLLM's StatelessProcessGroup is the same idea).

Backend: NCCL with device tensors on CUDA (each full tensor gathered by FSDP2 on the device is
copied into a device bucket and broadcast from there: no host copy, no pickling, no object
store); gloo with host tensors on CPU.

Memory: the trainer holds one bucket (``bucket_bytes``) beyond its shards, plus the one full
tensor being gathered (a tensor larger than a bucket is sent on its own, from where the gather
left it). A worker holds one bucket on its device while it arrives; it is then copied to the
worker's host, where a received version waits (the mailbox) until the engine loads it between
generations, as the object-store path's version does (fitrl/roles/rollout_worker.py).

Per bucket three broadcasts from rank 0: a header ``(manifest bytes, payload bytes)``, the
manifest (JSON: name, dtype, shape, offset of each tensor) and the payload (the tensors' bytes,
each at a 16-byte-aligned offset so that every dtype views in place). A header of zeros ends a
version.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

TRANSPORTS = ("auto", "object_store", "collective")

ALIGN = 16  # bytes: a payload offset every dtype (complex128 included) can be viewed at


def resolve_transport(transport: str, device_type: str, backend: str) -> str:
    """The weight transport a run uses: ``auto`` is ``collective`` for Ray runs on CUDA (device to
    device, NCCL) and ``object_store`` otherwise (CPU runs keep the host path; in one process the
    worker takes the trainer's tensors without a copy).

    >>> resolve_transport("auto", "cuda", "ray"), resolve_transport("auto", "cpu", "ray")
    ('collective', 'object_store')
    >>> resolve_transport("auto", "cuda", "inprocess"), resolve_transport("collective", "cpu", "ray")
    ('object_store', 'collective')
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"weight transport {transport!r} is not one of {TRANSPORTS}")
    if transport == "auto":
        return "collective" if device_type == "cuda" and backend == "ray" else "object_store"
    return transport


def channel_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True)
class ChannelAddress:
    """Where the channel's rendezvous is (the trainer's TCPStore) and how many ranks join."""

    host: str
    port: int
    world_size: int
    timeout_s: float


def open_rendezvous(host: str, world_size: int, timeout_s: float):
    """The trainer's side, before anyone joins: a TCPStore server on a port the OS picks (no probe
    and race), and its address for the workers."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, ChannelAddress(host, store.port, world_size, timeout_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class WeightChannel:
    """One rank's end of the channel; construction blocks until every rank has joined."""

    def __init__(self, address: ChannelAddress, rank: int, device: torch.device, store=None):
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, address.world_size, device
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False, timeout=timeout)
        self._store = store  # (the server lives as long as the trainer's end)
        prefixed = dist.PrefixStore("fitrl/weights/", store)
        if channel_backend(device.type) == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        # NCCL: wait() orders the current stream after the broadcast (the host does not block);
        # the next copy into a reused bucket runs on that stream, so it cannot overwrite it early
        self._pg.broadcast([t], self._opts).wait()
        return t

    def _header(self, manifest_len: int, payload_len: int) -> tuple[int, int]:
        h = torch.tensor([manifest_len, payload_len], dtype=torch.int64, device=self.device)
        return tuple(int(x) for x in self._broadcast(h).tolist())  # (a sync on CUDA: one per bucket)

    def _send_bucket(self, manifest: list, payload: torch.Tensor) -> None:
        text = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8).to(self.device)
        self._header(len(text), len(payload))
        self._broadcast(text)
        self._broadcast(payload)

    # -- the trainer's side (rank 0) ----------------------------------------------------------

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> int:
        """Broadcast ``(name, tensor)`` pairs in buckets of at most ``bucket_bytes`` (a tensor
        larger than that goes on its own); returns the buckets sent. Each tensor is copied into the
        bucket and may be dropped by the producer at once (FSDP2's gathered full tensors)."""
        if self.rank != 0:
            raise RuntimeError("only the channel's rank 0 (the trainer) sends")
        bucket: torch.Tensor | None = None  # (bucket_bytes,) uint8 on the channel's device, reused
        manifest: list = []
        used = sent = 0

        def flush() -> None:
            nonlocal manifest, used, sent
            if manifest:
                self._send_bucket(manifest, bucket[:used])
                manifest, used, sent = [], 0, sent + 1

        for name, t in weights:
            n = _nbytes(t)
            entry = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
            if _aligned(n) > bucket_bytes:  # alone, straight from where it is (no bucket copy)
                flush()
                flat = t.detach().to(self.device).contiguous().view(-1).view(torch.uint8)
                self._send_bucket([entry + [0]], flat)
                sent += 1
                continue
            if used + n > bucket_bytes:
                flush()
            if bucket is None:
                bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device)
            bucket[used:used + n].view(t.dtype).view(t.shape).copy_(t)  # (host shards: copied to the device here)
            manifest.append(entry + [used])
            used = min(_aligned(used + n), bucket_bytes)
        flush()
        self._header(0, 0)  # the version's end
        return sent

    # -- a worker's side ----------------------------------------------------------------------

    def receive(self) -> dict[str, torch.Tensor]:
        """One version, as rank 0 sent it: ``{name: tensor}`` on the host (see the module's
        Memory note), in the sender's dtypes and shapes."""
        out: dict[str, torch.Tensor] = {}
        for manifest, payload in self._buckets():
            host = payload.cpu()  # one D2H copy per bucket on CUDA; on CPU the bucket itself
            for name, dtype, shape, offset in manifest:
                dt = getattr(torch, dtype)
                n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                out[name] = host[offset:offset + n].view(dt).view(shape)
        return out

    def _buckets(self) -> Iterator[tuple[list, torch.Tensor]]:
        while True:
            manifest_len, payload_len = self._header(0, 0)
            if manifest_len == 0:
                return
            text = self._broadcast(torch.empty(manifest_len, dtype=torch.uint8, device=self.device))
            manifest = json.loads(bytes(text.cpu().tolist()).decode())
            yield manifest, self._broadcast(torch.empty(payload_len, dtype=torch.uint8, device=self.device))
