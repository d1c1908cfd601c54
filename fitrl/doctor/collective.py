"""Rungs ``collective`` (the node's devices, one process each) and ``ray`` (every node of a Ray
cluster): all-reduces through the backend fitrl's workers use, checked and timed."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fitrl.doctor.child import RankContext
from fitrl.doctor.ladder import Failure, Passed, Skip

MIB = 1024**2


def all_reduce_check(rank: int, world: int, device: torch.device, nbytes: int) -> dict:
    """All-reduce ``nbytes`` of fp32 on ``device`` (each rank holds ``rank + 1``) and a small host
    tensor (what CPU offload puts into collectives: gloo's half of ``cpu:gloo,cuda:nccl``);
    raises :class:`Failure` on a wrong sum. Collective: every rank calls it."""
    want = world * (world + 1) / 2
    x = torch.full((nbytes // 4,), float(rank + 1), device=device)
    dist.all_reduce(x)  # the first one sets up the communicator: warm-up, not timed
    x.fill_(float(rank + 1))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    sync()
    seconds = time.perf_counter() - t0
    got = {float(x.min()), float(x.max())}
    if got != {want}:
        raise Failure(f"all-reduce of {world} ranks on {device.type} summed to {sorted(got)}, not {want}",
                      "a transport that corrupts data: rerun with NCCL_DEBUG=INFO; try NCCL_P2P_DISABLE=1 to "
                      "tell a peer-to-peer fault from a network one")
    host = torch.full((1024,), float(rank + 1))
    dist.all_reduce(host)
    if float(host[0]) != want:
        raise Failure(f"all-reduce of host tensors summed to {float(host[0])}, not {want}")
    # bus bandwidth as nccl-tests defines it: what each link carried (2 (n-1)/n of the data)
    busbw = nbytes * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else 0.0
    return {"bytes": nbytes, "seconds": seconds, "busbw_gbps": busbw}


def collective(ctx: RankContext) -> Passed:
    backend = ctx.group()
    nbytes = 256 * MIB if ctx.device_type == "cuda" else 4 * MIB
    got = all_reduce_check(ctx.rank, ctx.world, ctx.device, nbytes)
    dist.barrier()
    bw = f", bus bandwidth {got['busbw_gbps']:.1f} GB/s" if ctx.world > 1 else " (one rank: no link measured)"
    what = f"{nbytes // MIB} MiB" + (" on the device and a host tensor" if ctx.device_type == "cuda" else "")
    return Passed(f"{backend} all-reduce over {ctx.world} process(es) on {ctx.device_type}: {what} summed right in "
                  f"{1e3 * got['seconds']:.1f} ms{bw}",
                  {"backend": backend, "world": ctx.world, **got})


class AllReducePeer:
    """One rank of the cluster-wide check, a worker of fitrl's Ray worker group (which joined
    the process group before building it)."""

    def __init__(self, *, rank: int, world_size: int):
        self.rank, self.world = rank, world_size

    def all_reduce(self) -> dict:
        import ray

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
            dist.get_backend() != "gloo" else torch.device("cpu")
        got = all_reduce_check(self.rank, self.world, device, 256 * MIB if device.type == "cuda" else 4 * MIB)
        return {**got, "node": ray.get_runtime_context().get_node_id()}


def ray_nodes(ctx: RankContext) -> Passed:
    address = ctx.options["ray_address"]  # (without one the parent skips this rung)
    try:
        import ray  # noqa: F401
    except Exception as e:  # absent, or broken on this node
        raise Skip(f"Ray is not importable here ({type(e).__name__}: {e}); the cross-node all-reduce needs it "
                   "(pip install ray, on every node)")
    from fitrl.workers.ray_group import RayWorkerGroup, ensure_ray

    ensure_ray(address)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    key = "GPU" if ctx.device_type == "cuda" else "CPU"
    per_node = [int(n["Resources"].get(key, 0)) for n in alive if n["Resources"].get(key, 0) >= 1]
    if not per_node:
        raise Failure(f"the Ray cluster at {address} has no node with a {key}", "start the nodes with `ray start`")
    devices = min(per_node) if key == "GPU" else 1  # one rank per GPU; on CPU one rank per node
    world = devices * len(per_node)
    group = RayWorkerGroup(AllReducePeer, world_size=world, nnodes=len(per_node), devices_per_node=devices,
                           use_gpu=key == "GPU", name="doctor", placement_timeout_s=60.0)
    try:
        got = group.call_all("all_reduce", [()] * world, {})
    finally:
        group.shutdown()
    slowest = min(g["busbw_gbps"] for g in got)
    bw = f"bus bandwidth {slowest:.1f} GB/s" if len(per_node) > 1 else "one node in the cluster: no link between nodes"
    return Passed(f"{len(per_node)} node(s) x {devices} rank(s) on {ctx.device_type} ({world} ranks): all-reduce "
                  f"summed right, {bw}", {"nodes": len(per_node), "world": world, "ranks": got})
