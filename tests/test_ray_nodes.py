"""Issue 66 on several nodes: a Ray cluster of two raylets on this machine (loopback), started by
the tests with Ray's own ``ray.cluster_utils.Cluster`` (the processes ``ray start --head`` and
``ray start --address`` would start, as children of this process: removing one is a lost node,
and the teardown stops exactly those). The head has 1 CPU, node b 2 CPUs and a ``node_b``
resource; it uses token authentication (a token of its own, in ``RAY_AUTH_TOKEN``). This
process joins it as a driver, and ``fitrl train`` runs join it with ``trainer.ray_address``.

- a driver without the cluster's auth token: one line, exit 2;
- one rank group per node, on distinct nodes, or a refusal naming every node and its free CPUs;
- a joined cluster that cannot hold a request waits ``placement_timeout_s`` for nodes to join,
  one whose room others hold waits as long; then one line;
- a 2-node run trains and checkpoints; SIGTERM while its resume waits for room stops in one line
  (exit 143), the checkpoint intact;
- a restart after a lost node, with no room left for one group per node, stops in one line within
  the limit (exit 2); with room (a third node joined), it rebuilds one group per node on the live
  nodes and finishes, every step recorded once.

The tier: ``pytest -m multinode`` (docs/testing.md); a minute or two here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from fitrl.core.errors import ClusterError
from helpers import DATA, EXAMPLE, ROOT

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.multinode]

LIMIT_S = 20  # trainer.placement_timeout_s of the runs here
AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


class Here:
    """A rank that says where it runs."""

    def __init__(self, *, rank: int, world_size: int):
        self.rank = rank

    def where(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), os.environ["LOCAL_WORLD_SIZE"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """The two-raylet cluster, joined by this process; ``nodes.b`` is node b's handle."""
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from fitrl.workers.ray_group import ensure_ray

    if ray.is_initialized():  # (an earlier module's private cluster)
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Token authentication, as `ray start --head` with a token: every process of the cluster, this
    # one and the `fitrl train` runs present it (inherited); a wrong one is refused.
    from ray._private.authentication_test_utils import reset_auth_token_state  # (Ray's own, for its tests)

    saved = {k: os.environ.get(k) for k in AUTH}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex})
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    reset_auth_token_state()  # this process read the mode when it imported ray
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": str(tmp_path_factory.mktemp("ray"))})
    module = sys.modules[__name__]
    try:
        cluster.b = cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        cloudpickle.register_pickle_by_value(module)  # (the Ray workers do not have tests/ on their path)
        ensure_ray(address=cluster.address)
        yield cluster
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        ray.shutdown()
        cluster.shutdown()  # the raylets, GCS and workers this fixture started, and nothing else
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        reset_auth_token_state()


def node_ids() -> dict[str, str]:
    """``head`` / ``b`` -> the live node's id."""
    return {("b" if "node_b" in n["Resources"] else "head"): n["NodeID"] for n in ray.nodes() if n["Alive"]}


def run_train(address: str, model_dir, run, *extra: str, wait: bool = True):
    """``fitrl train`` joining the cluster; the placement limit is ``LIMIT_S``."""
    args = [sys.executable, "-m", "fitrl.cli", "train", str(EXAMPLE), f"trainer.ray_address={address}",
            f"trainer.placement_timeout_s={LIMIT_S}", f"actor.model.path={model_dir}", f"trainer.run_dir={run}",
            f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]", "data.rollout_batch_size=4",
            "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.device=cpu",
            "trainer.backend=ray", "trainer.nnodes=2", "trainer.devices_per_node=1", "checkpoint.save_freq=1",
            "trainer.progress_bar=false", "memory.plan=off", "trainer.val_before_train=false", *extra]
    if wait:
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_for_a_trained_step(proc, run):
    """Wait until the run ``proc`` trains in ``run`` has recorded a step; its metrics file."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and any("reward/mean" in json.loads(line)
                                     for line in metrics.read_text().splitlines() if line.strip()):
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return metrics


def fitrl_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("fitrl:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_a_driver_without_the_clusters_auth_token_is_refused_in_one_line(nodes, tiny_model_dir, tmp_path):
    env = {**os.environ, "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "train", str(EXAMPLE),
                           f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                           "trainer.device=cpu", "trainer.backend=ray", f"trainer.ray_address={nodes.address}",
                           "memory.plan=off", "trainer.progress_bar=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = fitrl_line(proc.stderr)
    assert line.startswith(f"fitrl: ray cluster: trainer.ray_address={nodes.address}: the cluster at "), line
    assert "refused this process's Ray auth token (RPC error: InvalidAuthToken: Authentication token is missing or " \
           "incorrect); copy the head node's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN" in line, line


def test_one_rank_group_per_node_on_distinct_nodes_or_a_refusal_naming_them(nodes):
    from fitrl.workers.ray_group import RayWorkerGroup

    ids = node_ids()
    for _ in range(2):  # node b alone has room for both 1-CPU groups: each must still get a node of its own
        with RayWorkerGroup(Here, world_size=2, nnodes=2, num_cpus_per_worker=1, name="policy") as g:
            where = g.call_all("where", [()] * 2, {})
        assert {w[0] for w in where} == {ids["head"], ids["b"]} and {w[1] for w in where} == {"1"}
    start = time.monotonic()
    with pytest.raises(ClusterError) as info:  # 2 ranks on each of 2 nodes: only node b has 2 CPUs
        RayWorkerGroup(Here, world_size=4, nnodes=2, num_cpus_per_worker=1, name="policy", placement_timeout_s=3)
    took = time.monotonic() - start
    text = str(info.value)
    assert text.startswith("could not place policy: asked for 2 distinct nodes x 2 bundle(s) of {'CPU': 1} (one "
                           "rank group per node); only 1 of its 2 live node(s) have room for 2 bundle(s) each, and no "
                           "node joined within 3 s (trainer.placement_timeout_s). The cluster's 2 live node(s): "), text
    assert f"node {ids['head'][:8]} (" in text and "CPU 1 free of 1" in text, text
    assert f"node {ids['b'][:8]} (" in text and "CPU 2 free of 2" in text, text  # (its own bundles counted back)
    assert 2.5 < took < 60, took


def test_room_that_other_jobs_hold_is_waited_for_at_most_the_limit(nodes):
    from ray.util.placement_group import placement_group, remove_placement_group

    from fitrl.workers.ray_group import RayWorkerGroup

    other = placement_group([{"CPU": 2, "node_b": 1}])  # another job has node b
    ray.get(other.ready(), timeout=60)
    try:
        start = time.monotonic()
        with pytest.raises(ClusterError, match=r"1 of 2 placement group\(s\) were placed within 3 s "
                                               r"\(trainer.placement_timeout_s\): other jobs hold the room"):
            RayWorkerGroup(Here, world_size=2, nnodes=2, num_cpus_per_worker=1, name="policy", placement_timeout_s=3)
        assert 2.5 < time.monotonic() - start < 60
    finally:
        remove_placement_group(other)


def test_sigterm_while_a_resume_waits_for_room_stops_in_one_line_the_checkpoint_intact(nodes, tiny_model_dir,
                                                                                         tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group

    run = tmp_path / "run"
    first = run_train(nodes.address, tiny_model_dir, run, "trainer.max_steps=1")  # ranks on the 2 nodes
    assert first.returncode == 0, first.stderr[-3000:]
    step = run / "checkpoints" / "step_1"
    assert (step / "COMPLETE").is_file()
    before = {p.relative_to(run): p.read_bytes() for p in step.rglob("*") if p.is_file()}
    other = placement_group([{"CPU": 2, "node_b": 1}])  # another job takes node b before the resume
    ray.get(other.ready(), timeout=60)
    try:
        proc = run_train(nodes.address, tiny_model_dir, run, "trainer.max_steps=2", wait=False)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # until its policy group waits for room
            from ray.util.placement_group import placement_group_table

            if any(t["name"].startswith("fitrl-policy") and t["state"] == "PENDING"
                   for t in placement_group_table().values()):
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        remove_placement_group(other)
    assert proc.returncode == 143, stderr[-3000:]
    line = fitrl_line(stderr)
    assert line.startswith("fitrl: stopped by SIGTERM before training started (nothing to save), while policy "
                           "waited "), line
    assert took < 60, took  # (the wait's limit is 20 s: the stop came from the signal, within a slice)
    after = {p.relative_to(run): p.read_bytes() for p in step.rglob("*") if p.is_file()}
    assert after == before
    assert not (run / "checkpoints" / "step_2").exists()


def test_a_restart_after_a_lost_node_without_room_stops_in_one_line_within_the_limit(nodes, tiny_model_dir,
                                                                                      tmp_path):
    """Node b goes (its raylet and its rank killed) after step 1: ``trainer.max_restarts=1``
    rebuilds the groups, but one node is left for 2 per-node groups. Node b comes back after."""
    run = tmp_path / "run"
    proc = run_train(nodes.address, tiny_model_dir, run, "trainer.max_steps=200", "trainer.max_restarts=1",
                     wait=False)
    try:
        wait_for_a_trained_step(proc, run)
        nodes.remove_node(nodes.b)
        lost = time.monotonic()
        stdout, stderr = proc.communicate(timeout=600)
        took = time.monotonic() - lost
    finally:
        if proc.poll() is None:
            proc.kill()
        nodes.b = nodes.add_node(num_cpus=2, resources={"node_b": 1})
        nodes.wait_for_nodes()
    assert proc.returncode == 2, (stdout + stderr)[-3000:]
    assert "restart 1 of trainer.max_restarts=1: WorkerFailed: policy rank" in stdout, stdout[-3000:]
    line = fitrl_line(stderr)
    assert line.startswith("fitrl: ray cluster: could not place policy: asked for 2 distinct nodes x 1 bundle(s) of "
                           "{'CPU': 1} (one rank group per node); only 1 of its 1 live node(s) have room for 1 "
                           f"bundle(s) each, and no node joined within {LIMIT_S} s (trainer.placement_timeout_s)"), line
    assert LIMIT_S - 1 < took < LIMIT_S + 240, took  # the limit, plus the death noticed and a run rebuilt


def test_a_restart_after_a_lost_node_with_room_rebuilds_on_the_live_nodes_and_finishes(nodes, tiny_model_dir,
                                                                                       tmp_path):
    """Node c joins; node b goes after step 1: ``trainer.max_restarts=1`` rebuilds one group per
    node on the head and node c, resumes from the newest checkpoint and trains every step once."""
    c = nodes.add_node(num_cpus=2, resources={"node_c": 1})
    nodes.wait_for_nodes()
    run, steps = tmp_path / "run", 30
    proc = run_train(nodes.address, tiny_model_dir, run, f"trainer.max_steps={steps}", "trainer.max_restarts=1",
                     wait=False)
    try:
        metrics = wait_for_a_trained_step(proc, run)
        nodes.remove_node(nodes.b)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        nodes.remove_node(c)
        nodes.b = nodes.add_node(num_cpus=2, resources={"node_b": 1})
        nodes.wait_for_nodes()
    assert proc.returncode == 0 and "Traceback" not in stderr, (stdout + stderr)[-3000:]
    assert "restart 1 of trainer.max_restarts=1: WorkerFailed: policy rank" in stdout, stdout[-3000:]
    trained = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
               if line.strip() and "reward/mean" in json.loads(line)]
    assert trained == list(range(1, steps + 1)), trained  # resumed at its checkpoint: none twice, none lost
