"""Ray worker groups: dispatch over ranks, a real gloo process group, failures with causes.

The slow tests share one local Ray cluster (2 CPUs) started once for the module; the toy worker
below is shipped to the actors by value (``register_pickle_by_value``), since the Ray workers do
not have ``tests/`` on their path.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import pytest
import torch
import torch.distributed as dist

from fitrl.core.errors import WorkerFailed
from fitrl.data.batch import Batch
from fitrl.distributed.process_group import DistEnv, free_port
from fitrl.workers.group import RoleHandle, dispatch

ray = pytest.importorskip("ray")

from fitrl.workers.ray_group import (  # noqa: E402  (after the importorskip)
    RayWorkerGroup, describe_death, ensure_ray, rank_layout)
from fitrl.workers.ray_failures import with_prefix  # noqa: E402

CPUS = 0.5  # per rank: a 2-rank group takes 1 of the cluster's 2 CPUs, so two groups fit at once


class ToyWorker:
    """Rank-aware worker whose methods exercise the process group and the failure paths."""

    def __init__(self, scale: float = 1.0, *, rank: int, world_size: int, fail_init_rank: int = -1):
        if rank == fail_init_rank:
            raise ValueError(f"no weights for rank {rank}")
        assert dist.get_rank() == rank and dist.get_world_size() == world_size
        self.rank, self.scale = rank, scale

    @dispatch("dp")
    def forward(self, batch: Batch) -> Batch:
        total = batch["x"].sum()
        dist.all_reduce(total)  # gloo: every rank learns the sum over all shards
        n = len(batch)
        return Batch({"y": batch["x"] * self.scale, "rank": torch.full((n,), self.rank),
                      "total": total.expand(n).clone()}, {"seen_by": [f"rank{self.rank}"] * n})

    @dispatch("dp")
    def metrics(self, batch: Batch) -> dict:
        return {"rank": float(self.rank), "rows": float(len(batch))}

    @dispatch("all")
    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(),
                **{k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                              "MASTER_ADDR", "MASTER_PORT")}}

    @dispatch("dp")
    def raise_on(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            raise ValueError(f"shard of {len(batch)} rows is bad")
        return batch

    @dispatch("dp")
    def raise_then_collective(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            raise ValueError("gave up before the all_reduce")
        dist.all_reduce(torch.ones(1))  # the other rank waits here for ever
        return batch

    @dispatch("dp")
    def exit_on(self, batch: Batch, rank: int) -> Batch:
        if self.rank == rank:
            os._exit(1)
        dist.all_reduce(torch.ones(1))  # the survivor is mid-collective when its peer dies
        return batch


def _batch(n: int = 4) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float32)}, {"id": list(range(n))})


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    ensure_ray(address="local", num_cpus=2)
    yield
    cloudpickle.unregister_pickle_by_value(module)
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def group(cluster):
    with RayWorkerGroup(ToyWorker, 2.0, world_size=2, num_cpus_per_worker=CPUS, name="toy") as g:
        yield g


def _cpus_free_back(expected: float, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ray.available_resources().get("CPU", 0) >= expected:
            return True
        time.sleep(0.1)
    return False


# -- fast: pure helpers ---------------------------------------------------------------------------

def test_rank_layout_numbers_ranks_node_by_node():
    slots = rank_layout([["n1", "n2"], ["n2", "n1"]])
    assert [(s.node_id, s.pg, s.bundle, s.local_rank, s.local_world_size) for s in slots] == [
        ("n1", 0, 0, 0, 2), ("n1", 1, 1, 1, 2), ("n2", 0, 1, 0, 2), ("n2", 1, 0, 1, 2)]


def test_describe_death_tells_memory_kill_from_crash():
    import ray.exceptions as rex

    oom = rex.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory. Memory on the "
                               "node (IP: 10.0.0.2, ID: ab) was 30.1GB used / 31.0GB limit (0.97)\nOOM kill reason: x")
    kind, cause = describe_death(oom, "10.0.0.2")
    assert kind == "oom" and cause == "killed by the memory monitor (host OOM): node memory 30.1GB used / 31.0GB limit"
    died = rex.ActorDiedError()
    died.error_msg = ("The actor died unexpectedly before finishing this task.\n\tip: 10.0.0.2\nThe actor is dead "
                      "because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: "
                      "Task was killed due to the node running low on memory.")
    assert describe_death(died)[0] == "oom"
    # Ray's crash text lists "the OOM killer" as one possible cause: that is not a memory-monitor kill.
    died.error_msg = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                      "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some "
                      "common causes include: (1) the process was killed by the OOM killer due to high memory usage")
    kind, cause = describe_death(died, "10.0.0.2")
    assert kind == "crashed" and cause.startswith(
        "crashed (SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2. End of file.)")
    assert "dmesg` on 10.0.0.2" in cause


def test_worker_failed_message_and_pickle():
    e = WorkerFailed("policy", 3, "10.0.0.7", "update", "killed by the memory monitor (host OOM)", "ray text",
                     kind="oom", other_ranks={1: "RuntimeError (after the death)"})
    assert str(e).startswith("policy rank 3 on node 10.0.0.7 died during 'update': killed by the memory monitor "
                             "(host OOM); also rank 1: RuntimeError (after the death)\n    ray text")
    back = pickle.loads(pickle.dumps(e))
    assert (back.rank, back.kind, back.other_ranks, str(back)) == (3, "oom", e.other_ranks, str(e))


def test_with_prefix_keeps_type_and_args():
    e = with_prefix(KeyError("k"), "toy rank 1: ")
    assert isinstance(e, KeyError) and "toy rank 1: k" in str(e)
    e = with_prefix(OSError(2, "missing"), "toy rank 1: ")
    assert isinstance(e, OSError) and "toy rank 1: " in str(e)


def test_free_port_is_bindable_outside_the_ephemeral_range_and_not_seeded():
    import random
    import socket

    from fitrl.distributed.process_group import RENDEZVOUS_PORTS, _ephemeral_low

    ports = []
    for _ in range(5):
        random.seed(0)                          # ranks seeded alike must still draw apart
        ports.append(free_port())
    assert all(RENDEZVOUS_PORTS[0] <= p < min(RENDEZVOUS_PORTS[1], _ephemeral_low()) for p in ports)
    assert len(set(ports)) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", ports[-1]))


def test_dist_env_checks_ranks():
    with pytest.raises(ValueError, match="outside world size"):
        DistEnv(2, 2, 0, 2, "127.0.0.1", 1234)
    assert DistEnv(1, 4, 1, 2, "10.0.0.1", 29500).environ()["LOCAL_WORLD_SIZE"] == "2"


# -- slow: a real local cluster -------------------------------------------------------------------

@pytest.mark.slow
def test_dp_dispatch_splits_reduces_and_gathers(group):
    policy = RoleHandle(group)
    out = policy.forward(_batch(4))
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0]                  # scaled on the ranks, rank order kept
    assert out["rank"].tolist() == [0, 0, 1, 1]                       # each rank saw its own half
    assert out["seen_by"] == ["rank0", "rank0", "rank1", "rank1"]
    assert out["total"].tolist() == [6.0] * 4                         # all_reduce summed across processes
    assert policy.metrics(_batch(4)) == {"rank": 0.5, "rows": 2.0}    # dict results averaged
    assert policy.whoami()["rank"] == 0                               # "all": rank 0's answer


@pytest.mark.slow
def test_each_rank_is_its_own_process_with_torch_env(group):
    infos = group.call_all("whoami", [()] * 2, {})
    assert [i["RANK"] for i in infos] == ["0", "1"] and {i["WORLD_SIZE"] for i in infos} == {"2"}
    assert [i["LOCAL_RANK"] for i in infos] == ["0", "1"] and {i["LOCAL_WORLD_SIZE"] for i in infos} == {"2"}
    assert infos[0]["pid"] != infos[1]["pid"] != os.getpid()
    assert infos[0]["MASTER_ADDR"] == group.node_ips[0] == group.rank_info[0]["node_ip"]
    assert int(infos[0]["MASTER_PORT"]) == group.master_port


@pytest.mark.slow
def test_env_vars_reach_every_rank_at_start_preloading_an_allocator(cluster, group):
    """``memory.host_allocator``'s path under Ray: each rank's process starts with ``LD_PRELOAD``
    (Ray's runtime_env), so it maps jemalloc; a group without it keeps glibc."""
    from fitrl.core import allocator

    assert all(allocator.loaded("glibc", str(info["pid"])) for info in group.rank_info)
    if allocator.find_library("jemalloc") is None:
        pytest.skip("no libjemalloc.so.2 here (`make allocators`)")
    env = allocator.runtime_env_vars("jemalloc")
    free = ray.available_resources().get("CPU", 0)
    with RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="alloc", env_vars=env) as g:
        assert all(allocator.loaded("jemalloc", str(info["pid"])) for info in g.rank_info)
        assert RoleHandle(g).forward(_batch(4))["total"].tolist() == [6.0] * 4   # and they work as ever
    assert _cpus_free_back(free)   # (the next tests count the cluster's free CPUs)


@pytest.mark.slow
def test_exception_on_one_rank_names_it_and_group_survives(group):
    with pytest.raises(ValueError, match=r"^toy rank 1 \(node [\d.]+\) in 'raise_on': shard of 2 rows is bad") as info:
        RoleHandle(group).raise_on(_batch(4), 1)
    assert "raise ValueError" in str(info.value.__cause__)            # the remote traceback is chained
    assert RoleHandle(group).forward(_batch(2))["total"].tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_colocated_group_shares_bundles(group):
    free = ray.available_resources().get("CPU", 0)
    with RayWorkerGroup(ToyWorker, 3.0, world_size=2, colocate_with=group, name="ref") as ref:
        assert ray.available_resources().get("CPU", 0) == free        # no new reservation
        assert ref.node_ips == group.node_ips and ref.master_port != group.master_port
        assert RoleHandle(ref).forward(_batch(4))["y"].tolist() == [0.0, 3.0, 6.0, 9.0]
    assert RoleHandle(group).forward(_batch(2))["y"].tolist() == [0.0, 2.0]  # owner unaffected


@pytest.mark.slow
def test_crash_mid_collective_raises_worker_failed_promptly(cluster):
    free = ray.available_resources().get("CPU", 0)
    g = RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="policy")
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        RoleHandle(g).exit_on(_batch(4), 1)
    elapsed = time.monotonic() - start
    e = info.value
    assert (e.role, e.rank, e.phase, e.kind) == ("policy", 1, "exit_on", "crashed")
    assert str(e).startswith(f"policy rank 1 on node {g.node_ips[1]} died during 'exit_on': crashed")
    # ~2-5 s when quiet; 20x slack for a loaded CI machine still tells "noticed" from "hung"
    # (a hung collective waits torch's 30 min default)
    assert elapsed < 120, f"took {elapsed:.1f} s to notice the death"
    with pytest.raises(RuntimeError, match="shut down"):                # the group is gone, says so
        g.call_all("whoami", [()] * 2, {})
    assert _cpus_free_back(free)                                      # its bundles were released


@pytest.mark.slow
def test_rank_stuck_after_peer_raised_is_not_a_hang(cluster):
    free = ray.available_resources().get("CPU", 0)
    g = RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="policy", failure_grace_s=2.0)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^policy rank 1 .*ranks \[0\] were still running.*gave up before"):
        RoleHandle(g).raise_then_collective(_batch(4), 1)
    assert time.monotonic() - start < 60  # the grace is 2 s; 10x slack, far from a hang
    assert _cpus_free_back(free)


@pytest.mark.slow
def test_worker_init_failure_names_rank(cluster):
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(ValueError, match=r"^policy rank 1 \(node [\d.]+\) in '__init__': no weights for rank 1"):
        RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="policy", fail_init_rank=1)
    assert _cpus_free_back(free)


@pytest.mark.slow
def test_a_rendezvous_port_taken_after_the_probe_is_retried_on_another(cluster, monkeypatch):
    import socket

    import fitrl.workers.ray_group as ray_group

    free = ray.available_resources().get("CPU", 0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:  # a stranger's server
        squatter.bind(("", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        draws = iter([taken])
        monkeypatch.setattr(ray_group, "free_port", lambda: next(draws, None) or free_port())
        with RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="policy",
                            failure_grace_s=2) as g:
            assert g.master_port != taken
            assert RoleHandle(g).whoami()["MASTER_PORT"] == str(g.master_port)
    assert _cpus_free_back(free)


@pytest.mark.slow
def test_shutdown_kills_actors_and_frees_bundles(cluster):
    free = ray.available_resources().get("CPU", 0)
    g = RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=CPUS, name="policy")
    assert ray.available_resources().get("CPU", 0) == pytest.approx(free - 2 * CPUS)
    actors = list(g._actors)
    g.shutdown()
    g.shutdown()                                                      # idempotent
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.ready.remote(), timeout=10)
    assert _cpus_free_back(free)


@pytest.mark.slow
def test_placement_that_cannot_fit_fails_with_resources(cluster):
    from fitrl.core.errors import ClusterError

    with pytest.raises(ClusterError, match=r"could not place big: asked for 2 bundle\(s\) of \{'CPU': 10000\}"):
        RayWorkerGroup(ToyWorker, world_size=2, num_cpus_per_worker=10_000, name="big", placement_timeout_s=1)
