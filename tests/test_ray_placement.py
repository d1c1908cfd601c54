"""Issue 66 on one node: every wait on the Ray cluster bounded, every fault one line.

- which nodes can hold a request, and the refusal's words, on hand-written ``ray.nodes()``
  answers (fitrl/workers/ray_nodes.py);
- a placement a cluster this process started can never give (more CPUs than it has, more
  rollout workers than the CPUs the policy leaves) is refused at once, naming what was asked and
  what each node has free;
- ``trainer.ray_address`` that does not answer: one line within seconds, exit 2;
- SIGTERM while a group waits for its bundles: one line naming the wait, exit 143;
- a rank whose node lacks the model directory (``FITRL_INJECT_OWN_DISK=...:model:``, as on a
  node without the shared mount) and a user error raised on a rank: the same user error on the
  driver, naming the rank, its node and host, and the path (exit 2).

Several real nodes: tests/test_ray_nodes.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from fitrl.config import ConfigError
from fitrl.core.errors import ClusterError, UserError
from fitrl.workers.ray_nodes import Node, describe, live_nodes, never_fits
from helpers import DATA, EXAMPLE, ROOT

A = "a" * 56
B = "b" * 56


def nodes_answer() -> list[dict]:
    """What ``ray.nodes()`` says of a 2-node cluster: a head with 8 CPUs and 2 GPUs, a worker
    with 4 CPUs and 1 GPU, and a dead third node."""
    return [
        {"NodeID": A, "Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeManagerHostname": "head",
         "Resources": {"CPU": 8.0, "GPU": 2.0, "memory": 1e10, "node:10.0.0.1": 1.0}},
        {"NodeID": B, "Alive": True, "NodeManagerAddress": "10.0.0.2", "NodeManagerHostname": "gpu-2",
         "Resources": {"CPU": 4.0, "GPU": 1.0}},
        {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3", "NodeManagerHostname": "gone",
         "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fitrl(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitrl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**__import__("os").environ, **(env or {})})


def ray_train(model_dir, run, *extra: str) -> list[str]:
    return ["train", str(EXAMPLE), f"actor.model.path={model_dir}", f"trainer.run_dir={run}",
            f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]", "data.rollout_batch_size=4",
            "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.device=cpu",
            "trainer.backend=ray", "trainer.devices_per_node=2", "trainer.progress_bar=false", "memory.plan=off",
            *extra]


def one_fitrl_line(stderr: str) -> str:
    """The single ``fitrl:`` line a user error ends with, and no traceback."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("fitrl:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


# -- pure: the rules on a hand-written cluster -------------------------------------------------------

def test_dead_nodes_do_not_count_and_distinct_nodes_need_room_on_each():
    nodes = live_nodes(nodes_answer())
    assert [n.host for n in nodes] == ["head", "gpu-2"]
    gpu = {"CPU": 1.0, "GPU": 1.0}
    assert never_fits(nodes, gpu, 2, 2, {}) is None                         # one GPU rank on each node
    assert never_fits(nodes, gpu, 3, 1, {}) is None                         # PACK may span the two nodes
    assert never_fits(nodes, gpu, 4, 2, {}) == "only 1 of its 2 live node(s) have room for 2 bundle(s) each"
    assert never_fits(nodes, gpu, 4, 1, {}) == "its 2 live node(s) have room for 3 such bundle(s) in all"
    # what this run's policy holds is not room for its rollout workers, though the totals are
    assert never_fits(nodes, gpu, 2, 1, {A: {"CPU": 2.0, "GPU": 2.0}}) == (
        "its 2 live node(s) have room for 1 such bundle(s) in all, besides what this run holds")


def test_the_refusal_names_each_node_with_its_free_and_total_resources():
    free = {A: {"CPU": 6.0, "GPU": 0.0}, B: {"CPU": 4.0, "GPU": 1.0}}
    nodes = live_nodes(nodes_answer(), free)
    text = describe(nodes, {"CPU": 1.0, "GPU": 1.0}, {A: {"CPU": 2.0, "GPU": 2.0}})
    assert text == ("node aaaaaaaa (10.0.0.1, host head): CPU 6 free of 8, GPU 0 free of 2 (this run holds CPU 2, "
                    "GPU 2); node bbbbbbbb (10.0.0.2, host gpu-2): CPU 4 free of 4, GPU 1 free of 1")
    assert describe([Node(B, "10.0.0.2", "gpu-2", {"CPU": 4.0})], {"CPU": 1.0}, {}) == (
        "node bbbbbbbb (10.0.0.2, host gpu-2): CPU 4, GPU 0")                # Ray said nothing of free
    assert describe([], {"CPU": 1.0}, {}) == "no live node"


def test_the_rules_doctests_hold():
    import doctest

    from fitrl.workers import ray_nodes, ray_placement

    for module in (ray_nodes, ray_placement):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_placement_timeout_is_a_checked_setting():
    from fitrl.config.run import TrainerConfig

    assert TrainerConfig().placement_timeout_s == 300.0
    for bad in (0, -1, float("inf"), True):
        with pytest.raises(ConfigError, match="trainer.placement_timeout_s must be a number of seconds > 0"):
            TrainerConfig(placement_timeout_s=bad)


def test_an_address_that_does_not_answer_is_one_line_within_seconds():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already")
    from fitrl.workers.ray_cluster import probe_address
    from fitrl.workers.ray_group import ensure_ray

    port = closed_port()
    start = time.monotonic()
    with pytest.raises(ClusterError, match=rf"^trainer.ray_address=127.0.0.1:{port}: nothing answers at \S+:{port} "
                                           r"\(Connection refused.*`ray start --head"):
        ensure_ray(address=f"127.0.0.1:{port}")
    assert time.monotonic() - start < 60 and not ray.is_initialized()   # (the probe's limit is 5 s)
    with pytest.raises(ClusterError, match="not HOST:PORT"):
        probe_address("10.0.0.1:http")


# -- a private cluster: refused at once, SIGTERM, a rank's user error ---------------------------------

class Peer:
    """A rank that raises a user error when told to, on its own node's say."""

    def __init__(self, *, rank: int, world_size: int, bad_rank: int = -1):
        if rank == bad_rank:
            raise ConfigError(f"data.train_files=/data/x.jsonl does not exist on rank {rank}'s node")
        self.rank = rank

    def whoami(self) -> int:
        return self.rank


@pytest.fixture(scope="module")
def private_cluster():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from fitrl.workers.ray_group import ensure_ray

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # (the Ray workers do not have tests/ on their path)
    started = not ray.is_initialized()
    ensure_ray(address="local", num_cpus=2)
    yield ray
    cloudpickle.unregister_pickle_by_value(module)
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_more_than_a_private_cluster_has_is_refused_at_once(private_cluster):
    from fitrl.workers.ray_group import RayWorkerGroup

    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"^could not place big: asked for 2 bundle\(s\) of \{'CPU': 10000\} \(one "
                                           r"per rank\); its 1 live node\(s\) have room for 0 such bundle\(s\) in all, "
                                           r"and no node can join the cluster this process started\. The cluster's 1 "
                                           r"live node\(s\): node \w{8} \([\d.]+, host \S+\): CPU 2 free of 2"):
        RayWorkerGroup(Peer, world_size=2, num_cpus_per_worker=10_000, name="big", placement_timeout_s=600)
    # the policy holds 1 of the 2 CPUs: 3 rollout workers of 0.5 CPU can never be placed beside it
    with RayWorkerGroup(Peer, world_size=2, num_cpus_per_worker=0.5, name="policy"):
        with pytest.raises(ClusterError, match=r"could not place rollout: asked for 3 bundle\(s\) of \{'CPU': 0.5\}.*"
                                               r"room for 2 such bundle\(s\) in all, besides what this run holds.*"
                                               r"CPU 1 free of 2, GPU 0 free of 0 \(this run holds CPU 1\)"):
            RayWorkerGroup(Peer, world_size=3, num_cpus_per_worker=0.5, name="rollout", placement_timeout_s=600)
    assert time.monotonic() - start < 120  # not the 600 s limit: refused as soon as asked (~3 s here)


@pytest.mark.slow
def test_a_user_error_on_a_rank_stays_a_user_error_naming_the_rank(private_cluster):
    from fitrl.workers.ray_group import RayWorkerGroup

    with pytest.raises(ConfigError, match=r"^policy rank 1 \(node [\d.]+\) in '__init__': data.train_files="
                                          r"/data/x.jsonl does not exist on rank 1's node$") as info:
        RayWorkerGroup(Peer, world_size=2, num_cpus_per_worker=0.5, name="policy", bad_rank=1)
    assert isinstance(info.value, UserError)


SIGTERM_WHILE_PLACING = '''
import os, signal, sys, threading, time
import ray
from ray.util.placement_group import placement_group
from fitrl.core.errors import Interrupted
from fitrl.trainer.signals import SIGNALS
from fitrl.workers.ray_group import RayWorkerGroup, ensure_ray

class Idle:
    def __init__(self, *, rank, world_size):
        pass

with SIGNALS.handled():
    ensure_ray(address="local", num_cpus=1)
    SIGNALS.reinstall()  # (as fitrl/trainer/run.py does after ray.init)
    other = placement_group([{"CPU": 1}])  # another job holds the only CPU: a wait, not a refusal
    ray.get(other.ready(), timeout=60)
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    start = time.monotonic()
    try:
        RayWorkerGroup(Idle, world_size=1, num_cpus_per_worker=1, name="policy", placement_timeout_s=300)
    except Interrupted as e:
        print(f"{time.monotonic() - start:.1f} {e}")
        sys.exit(e.exit_status)
'''


@pytest.mark.slow
def test_sigterm_while_a_group_waits_for_its_bundles_stops_in_one_line():
    """Ray's C++ wait would hold a raised signal for its whole timeout and hand back a SystemError
    (the internal-error banner); waited in slices, the stop lands within a second, named."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SIGTERM_WHILE_PLACING)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 143, proc.stdout + proc.stderr[-3000:]
    waited, _, line = proc.stdout.strip().partition(" ")
    assert line.startswith("stopped by SIGTERM before training started (nothing to save), while policy waited"), line
    assert "for the Ray cluster to place its ranks" in line
    assert 2.5 < float(waited) < 60, waited  # the signal came 3 s in, not after the 300 s limit
    assert "SystemError" not in proc.stderr


@pytest.mark.slow
@pytest.mark.cli
def test_a_ray_address_that_does_not_answer_stops_the_run_with_exit_2(tiny_model_dir, tmp_path):
    port = closed_port()
    start = time.monotonic()
    proc = fitrl(*ray_train(tiny_model_dir, tmp_path / "run", f"trainer.ray_address=127.0.0.1:{port}"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_fitrl_line(proc.stderr)
    assert line.startswith(f"fitrl: ray cluster: trainer.ray_address=127.0.0.1:{port}: nothing answers at "), line
    assert "`ray start --head --port=6379`" in line
    assert time.monotonic() - start < 300  # ray.init alone would retry for 13 minutes


@pytest.mark.slow
@pytest.mark.cli
def test_a_rank_whose_node_lacks_the_model_is_named_with_its_node_and_path(tiny_model_dir, tmp_path):
    """Rank 1 sees its own disk for the model (``FITRL_INJECT_OWN_DISK``): the driver's checks
    pass, rank 1's fails; its rank-0 peer waiting in the weights' broadcast is not waited for."""
    proc = fitrl(*ray_train(tiny_model_dir, tmp_path / "run", "trainer.max_steps=1"),
                 env={"FITRL_INJECT_OWN_DISK": f"policy:1:model:{tmp_path / 'node-disk'}"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = one_fitrl_line(proc.stderr)
    assert line.startswith(f"fitrl: model error: policy rank 1 (node "), line
    assert (f"in '__init__': actor.model.path={tiny_model_dir} does not exist on host {socket.gethostname()}, "
            f"where this process runs: every node of a Ray cluster needs it at the same path") in line
    assert "still running" not in line
