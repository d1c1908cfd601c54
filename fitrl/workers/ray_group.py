"""The Ray backend of the worker-group interface: one Ray actor per rank, one process group per role.

    ensure_ray()                                   # local cluster, dashboard off (or join one)
    with RayWorkerGroup(PolicyWorker, cfg, world_size=2, name="policy") as group:
        policy = RoleHandle(group)                 # the driver code is the same as in-process
        out = policy.generate(prompts, sampling)   # split over ranks, gathered in rank order

What happens when a group is built:

1. **Placement.** A placement group reserves one bundle per rank (``num_cpus_per_worker`` CPUs,
   plus one GPU with ``use_gpu``): with ``nnodes=1`` one group of ``world_size`` bundles,
   ``PACK``; with ``nnodes>1`` one ``STRICT_PACK`` group of ``devices_per_node`` bundles per
   node, each on a node of its own (guaranteed, or refused). Ranks are numbered node by node
   (all of rank 0's node first), so ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` describe the real
   layout, and a hybrid-shard mesh ``(nnodes, devices_per_node)`` shards within a node and
   replicates across nodes. A request the cluster can never give, or does not give within
   ``placement_timeout_s``, is one :class:`~fitrl.core.errors.ClusterError` line naming what was
   asked and each node's free CPUs and GPUs (:mod:`fitrl.workers.ray_placement`).
2. **Rendezvous.** The driver picks ``MASTER_ADDR`` = rank 0's node IP and a port free on that
   node (probed there by a zero-CPU task when it is not the driver's node).
3. **Actors.** Each rank's actor exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
   ``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, sets the torch thread count to its CPU
   share, calls ``torch.distributed.init_process_group`` (gloo on CPU; on GPU
   ``cpu:gloo,cuda:nccl``, gloo serving offloaded host tensors, with the actor's GPU made
   current) and only then constructs ``worker_cls(*args, rank=, world_size=, **kwargs)``, so a
   worker's ``__init__`` may already use collectives (FSDP2, rank-0 loading).

Actors request no CPU and a token GPU share themselves: the bundles hold the reservation.
That is what lets another role share the same bundles: ``RayWorkerGroup(ReferenceWorker, cfg,
world_size=2, colocate_with=policy_group, name="ref")`` puts ref rank *i* in policy rank *i*'s
bundle (same node, same GPU), with its own process group; the bundles are released when the
last group sharing them shuts down.

The pieces live beside this module: :mod:`fitrl.workers.ray_cluster` (joining, bounded waits),
:mod:`fitrl.workers.ray_placement` (bundles, rank numbering) and :mod:`fitrl.workers.ray_nodes`
(which nodes can hold them), :mod:`fitrl.workers.ray_actor` (what runs in each actor) and
:mod:`fitrl.workers.ray_failures` (what a failure on a rank means).

Failures: a Python exception on a rank is re-raised on the driver with its original type, the
message prefixed ``"<role> rank <r> (node <ip>) in '<method>': "`` and the remote traceback
chained (a user error stays one: exit 2, e.g. a model directory missing on that rank's node,
fitrl/models/loading.py). A dead actor (crash, ``os._exit``, segfault, Ray's memory monitor, a
lost node) raises :class:`WorkerFailed` naming role, rank, node, method and cause - ``"killed by
the memory monitor (host OOM)"`` vs ``"crashed (...)"`` - as soon as Ray notices, and the group
is shut down (the other ranks would otherwise wait in a collective for ever). When one rank raises
while others are still running ``failure_grace_s`` later (typically blocked in a collective
that the failed rank never joined), the group is shut down for the same reason.

Multi-node
----------
Every node needs the same environment: this repository installed in a virtualenv at the same
path, the model and data paths readable (shared storage or copies at the same path), and
``trainer.run_dir`` on one filesystem every node shares, where each rank writes its checkpoint
shards (checked before step 1, ``check_shared`` in fitrl/trainer/rundir.py)::

    # head node (its IP: HEAD)
    ray start --head --port=6379 --num-gpus=8
    # every other node, with the head's Ray auth token when the head uses one (copy its
    # ~/.ray/auth_token, or RAY_AUTH_TOKEN=...; docs/distributed.md, "Joining a cluster")
    ray start --address=HEAD:6379 --num-gpus=8
    # on the head node: join the running cluster (trainer.ray_address=auto, or export
    # RAY_ADDRESS=HEAD:6379) instead of starting a private local one
    fitrl train CONFIG trainer.backend=ray trainer.nnodes=2 trainer.devices_per_node=8 \
        trainer.ray_address=auto

``ray status`` shows the nodes and free resources; ``ray stop`` on each node ends the cluster.
An address that does not answer is one line within seconds (:func:`ensure_ray`).
NCCL picks the network by itself; set ``NCCL_SOCKET_IFNAME`` (and for gloo
``GLOO_SOCKET_IFNAME``) in the environment of ``ray start`` when nodes have several interfaces.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from fitrl.core.errors import WorkerFailed
from fitrl.distributed.process_group import DistEnv, default_backend, free_port, is_port_taken
from fitrl.telemetry.guard import MemoryPressure
from fitrl.telemetry.phases import current_phase
from fitrl.workers.group import Pending, WorkerGroup
from fitrl.workers.ray_actor import remote
from fitrl.workers.ray_cluster import (PROBE_TIMEOUT_S, cluster_devices, ensure_ray, probe_gpu,  # noqa: F401
                                       read_gpu, wait)  # (re-exported)
from fitrl.workers.ray_failures import (ANSI_RE, RemoteTraceback, describe_death, is_death, is_memory_pressure,
                                        with_prefix)
from fitrl.workers.ray_placement import Placement, RankSlot, rank_layout

__all__ = ["RayWorkerGroup", "RankSlot", "ensure_ray", "rank_layout", "describe_death"]

POLL_S = 1.0
"""The longest single wait for the ranks' results (see :meth:`RayWorkerGroup._collect`)."""

# ray is imported inside the functions that use it: importing this module needs no ray.

log = logging.getLogger(__name__)

# Each actor asks for this much of its bundle's GPU: enough for Ray to hand it the bundle's GPU
# (CUDA_VISIBLE_DEVICES), small enough for several roles to share one bundle.
GPU_SHARE = 0.01

# A rendezvous whose port another process took in the moment after it was probed is retried on
# a fresh port (fitrl/distributed/process_group.py: free_port)
PORT_ATTEMPTS = 3


class RayWorkerGroup(WorkerGroup):
    """``world_size`` Ray actors, each holding one rank of ``worker_cls`` in one process group.

    Args:
        worker_cls: built on each rank as ``worker_cls(*args, rank=r, world_size=n, **kwargs)``.
        world_size: number of ranks; ``nnodes * devices_per_node``.
        nnodes: nodes to spread over (one STRICT_PACK placement group per node when > 1).
        devices_per_node: ranks per node; default ``world_size // nnodes``.
        num_cpus_per_worker: CPUs reserved per rank; also the rank's torch thread count.
        use_gpu: one GPU per rank and ``cpu:gloo,cuda:nccl``; otherwise gloo on CPU.
        name: the role, used in messages, actor reprs (Ray logs) and placement-group names.
        colocate_with: another ``RayWorkerGroup`` whose bundles this group shares, rank by rank.
        backend: override the process-group backend (e.g. ``"cpu:gloo,cuda:nccl"``).
        placement_timeout_s: the longest wait for the cluster to give the bundles (default
            :data:`~fitrl.workers.ray_placement.PLACEMENT_TIMEOUT_S`); a request the cluster can
            never give is refused sooner (fitrl/workers/ray_placement.py).
        failure_grace_s: after one rank raises, how long the others may take to finish before
            the group is judged stuck and shut down.
        dist_timeout_s: ``init_process_group`` timeout (also the collective timeout);
            default: torch's.
        env_vars: environment variables of the ranks' processes, set when each starts (Ray's
            ``runtime_env``: a process of its own per rank), e.g. ``LD_PRELOAD`` for
            ``memory.host_allocator`` (fitrl/core/allocator.py).
    """

    def __init__(self, worker_cls: type, *args, world_size: int, nnodes: int = 1,
                 devices_per_node: Optional[int] = None, num_cpus_per_worker: float = 1, use_gpu: bool = False,
                 name: str = "policy", colocate_with: Optional["RayWorkerGroup"] = None,
                 backend: Optional[str] = None, placement_timeout_s: Optional[float] = None,
                 failure_grace_s: float = 10.0, dist_timeout_s: Optional[float] = None,
                 env_vars: Optional[dict] = None, **kwargs):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not connected: call fitrl.workers.ray_group.ensure_ray() first")
        devices_per_node = devices_per_node or world_size // max(nnodes, 1)
        if nnodes < 1 or devices_per_node < 1 or nnodes * devices_per_node != world_size:
            raise ValueError(f"{name}: world_size={world_size} must equal nnodes ({nnodes}) x devices_per_node "
                             f"({devices_per_node})")
        self.worker_cls, self.world_size, self.name = worker_cls, world_size, name
        self.nnodes, self.devices_per_node, self.use_gpu = nnodes, devices_per_node, use_gpu
        self.failure_grace_s = failure_grace_s
        self._actors: list = []
        self._failed: Optional[str] = None
        # main-thread calls sent and not yet collected, oldest first: a rank runs them in this
        # order, so when it dies the oldest is what it was doing (whichever call noticed)
        self._running: list[tuple[str, int]] = []  # (method, id of its refs: holding them would pin results)
        self._placement: Optional[Placement] = None

        if colocate_with is not None:
            other = colocate_with._placement
            if other is None or not other.pgs:
                raise RuntimeError(f"{name}: cannot colocate with {colocate_with.name}, which is shut down")
            if colocate_with.world_size != world_size or colocate_with.use_gpu != use_gpu:
                raise ValueError(f"{name}: colocating needs the same world size and device kind as "
                                 f"{colocate_with.name} ({colocate_with.world_size} ranks, use_gpu="
                                 f"{colocate_with.use_gpu}); got {world_size}, use_gpu={use_gpu}")
            placement = other
        else:
            bundle = {"CPU": num_cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
            placement = Placement(world_size, nnodes, devices_per_node, bundle, placement_timeout_s, name)
        placement.users += 1
        self.node_ips: list[str] = list(placement.node_ips)
        # self._placement is set once the ranks are up: a failed start's shutdown() (from
        # _failure) then kills the actors but keeps the bundles for the next attempt
        try:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    self._start_ranks(placement, use_gpu, backend, dist_timeout_s, env_vars, args, kwargs)
                    break
                except Exception as e:
                    if attempt == PORT_ATTEMPTS or not is_port_taken(e):
                        raise
                    log.warning("%s: rendezvous port %d was taken before rank 0 bound it; retrying on another "
                                "(attempt %d of %d)", name, self.master_port, attempt + 1, PORT_ATTEMPTS)
                    self.shutdown()
                    self._failed = None
            self._placement = placement
        except BaseException:
            self._placement = placement
            self.shutdown()
            raise

    def _start_ranks(self, placement: Placement, use_gpu: bool, backend: Optional[str],
                     dist_timeout_s: Optional[float], env_vars: Optional[dict], args: tuple, kwargs: dict) -> None:
        """Rendezvous at rank 0's node, on a port free there; one actor per rank, each joining the
        process group before building its worker. Raises what a rank raised."""
        import ray
        from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                    PlacementGroupSchedulingStrategy)

        node0 = placement.slots[0].node_id
        if node0 == ray.get_runtime_context().get_node_id():
            port = free_port()
        else:
            port = ray.get(remote("port").options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node0, soft=False)).remote())
        self.master_addr, self.master_port = self.node_ips[0], port
        backend = backend or default_backend(use_gpu)
        threads = max(1, int(placement.bundle.get("CPU", 1)))
        for rank, slot in enumerate(placement.slots):
            env = DistEnv(rank, self.world_size, slot.local_rank, slot.local_world_size, self.master_addr, port)
            strategy = PlacementGroupSchedulingStrategy(placement.pgs[slot.pg],
                                                        placement_group_bundle_index=slot.bundle)
            actor = remote("actor").options(num_cpus=0, num_gpus=GPU_SHARE if use_gpu else 0,
                                             scheduling_strategy=strategy,
                                             **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}))
            self._actors.append(actor.remote(self.name, env, backend, threads, dist_timeout_s,
                                             self.worker_cls, args, kwargs))
        self.rank_info: list[dict] = self._collect([a.ready.remote() for a in self._actors], "__init__")

    # -- calls --------------------------------------------------------------------------------

    def call_all(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list[Any]:
        # the ranks record their memory under the driver's phase
        return self._collect(self._send(method, per_rank_args, kwargs, current_phase()), method)

    def submit(self, method: str, per_rank_args: list[tuple], kwargs: dict, phase: Optional[str] = None,
               mailbox: bool = False) -> Pending:
        """As ``call_all``, without waiting; ``mailbox``: on the actor's ``mailbox`` thread, beside
        a running call (:meth:`WorkerGroup.submit`)."""
        import ray

        refs = self._send(method, per_rank_args, kwargs, None if mailbox else phase, mailbox)
        return Pending(lambda: self._collect(refs, method),
                       lambda: len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs))

    def call_kept(self, method: str, per_rank_args: list[tuple], kwargs: dict) -> list[Any]:
        """The ranks' results as object-store handles, once every rank has finished (a failure
        raises as in ``call_all``); another group's call takes them as arguments."""
        # each a one-element list: the handle inside is not fetched
        boxed = self._collect(self._send(method, per_rank_args, kwargs, current_phase(), via="call_kept"), method)
        return [b[0] for b in boxed]

    def _send(self, method: str, per_rank_args: list[tuple], kwargs: dict, phase: Optional[str],
              mailbox: bool = False, via: str = "call") -> list:
        """Start ``method`` on every rank through the actors' ``via`` (``call``, ``call_kept``)."""
        import ray

        if self._failed:
            raise RuntimeError(f"{self.name} group is shut down ({self._failed}); build a new one")
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"{method}: {len(per_rank_args)} argument tuples for {self.world_size} ranks")
        args = per_rank_args
        if self.world_size > 1 and all(a is per_rank_args[0] for a in per_rank_args):
            args = [ray.put(per_rank_args[0])] * self.world_size  # one copy in the object store, not n
        calls = [getattr(a, via) for a in self._actors]
        refs = [(c.options(concurrency_group="mailbox") if mailbox else c).remote(method, x, kwargs, phase)
                for c, x in zip(calls, args)]
        if not mailbox:
            self._running.append((method, id(refs)))
        return refs

    def health(self, timeout_s: float) -> list[dict]:
        """Each rank's phase, idle seconds and main-thread stack, asked in the actors' ``health``
        thread (it answers while a rank is stuck); a rank that does not answer in ``timeout_s``
        is reported with ``idle_s`` None and why."""
        import ray

        refs = [a.health.options(concurrency_group="health").remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    out.append(ray.get(ref))
                    continue
                except Exception as e:  # a dead actor: the group's own error reporting names the cause
                    error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            else:
                error = "no reply"
            out.append({"role": self.name, "rank": rank, "idle_s": None, "error": error})
        return out

    def memory_reports(self) -> list[tuple[dict, Any]]:
        """Per rank: (phase -> PhaseMemory since the last report, a pending guard crossing or None)."""
        # on the mailbox thread: a rollout worker may be generating (its finished phases are drained)
        return self._collect([a.memory_report.options(concurrency_group="mailbox").remote() for a in self._actors],
                             "memory_report")

    def skipped_prompts(self) -> list[dict[str, list[int]]]:
        """Per rank: phase -> the prompt copies its passes did not run since the last call."""
        return self._collect([a.skipped_prompts.options(concurrency_group="mailbox").remote() for a in self._actors],
                             "skipped_prompts")

    def _collect(self, refs: list, method: str) -> list[Any]:
        """Results in rank order; on the first failure, the cause (see the module docstring)."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        errors: dict[int, BaseException] = {}
        deadline = None
        while pending:
            # waits of at most POLL_S: between them the main thread runs Python, so the hang
            # watchdog's Hung (raised there, fitrl/trainer/watchdog.py) lands at once and the
            # run stops or restarts cleanly, instead of the watchdog ending the process
            timeout = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            done, _ = wait(list(pending), 1, timeout)  # (a second SIGTERM raises here, not in Ray's C++)
            if not done:
                if deadline is None or time.monotonic() < deadline:
                    continue
                break
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as e:
                    errors[rank] = e
                    if is_death(e):  # no point waiting: gather what else failed with it, then stop
                        deadline = time.monotonic() + min(1.0, self.failure_grace_s)
                    elif deadline is None and not is_memory_pressure(e):
                        # a guard stop is not a hang: the other ranks finish their (collective-free)
                        # phase or leave at the same safe point, and the group stays usable;
                        # a group whose start failed is discarded whatever its other ranks do
                        deadline = time.monotonic() + (min(1.0, self.failure_grace_s) if method == "__init__"
                                                       else self.failure_grace_s)
        mine = next((k for k, (_, i) in enumerate(self._running) if i == id(refs)), None)
        # the oldest main-thread call, when sent before this one (a mailbox call runs beside it)
        running = self._running[0][0] if self._running and mine != 0 else None
        self._running = [(m, i) for m, i in self._running if i != id(refs)]
        if not errors:
            return results
        raise self._failure(errors, sorted(pending.values()), method, running)

    def _failure(self, errors: dict[int, BaseException], stuck: list[int], method: str,
                 running: Optional[str] = None) -> BaseException:
        """``running``: a main-thread call sent before ``method`` and still unanswered (a death is
        reported as during it: ``method`` only noticed)."""
        import ray.exceptions as rex

        deaths = {r: e for r, e in errors.items() if is_death(e)}
        if deaths:
            causes = {r: describe_death(e, self.node_ips[r]) for r, e in deaths.items()}
            # A memory kill explains the rest (peers see broken connections); else the lowest rank.
            rank = next((r for r in sorted(causes) if causes[r][0] == "oom"), min(causes))
            kind, cause = causes[rank]
            others = {r: c for r, (_, c) in causes.items() if r != rank}
            others.update({r: f"{type(getattr(e, 'cause', e)).__name__} (after the death)"
                           for r, e in errors.items() if r not in deaths})
            err = WorkerFailed(self.name, rank, self.node_ips[rank], running or method, cause,
                               ANSI_RE.sub("", str(deaths[rank])), kind=kind, other_ranks=others)
            self._failed = f"{self.name} rank {rank} {cause}"
            self.shutdown()
            return err
        causes = {r: (e.cause if isinstance(e, rex.RayTaskError) else e) for r, e in errors.items()}
        pressure = [c for r, c in sorted(causes.items()) if isinstance(c, MemoryPressure)]
        if pressure and not stuck:  # every rank left the phase together: the group is intact
            return next((c for c in pressure if c.origin), pressure[0])
        rank = min(errors)
        e = errors[rank]
        cause = causes[rank]
        prefix = f"{self.name} rank {rank} (node {self.node_ips[rank]}) in {method!r}: "
        if stuck:
            if method != "__init__":  # (the peers of a rank that could not start wait for it: no news)
                prefix += (f"[ranks {stuck} were still running {self.failure_grace_s:.0f} s later, likely waiting "
                           f"in a collective; the group was shut down] ")
            self._failed = f"rank {rank} raised in {method!r} while ranks {stuck} hung"
            self.shutdown()
        new = with_prefix(cause, prefix)
        if isinstance(e, rex.RayTaskError):
            new.__cause__ = RemoteTraceback(ANSI_RE.sub("", str(e)))  # the remote frames
        return new

    # -- lifetime -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Destroy the process group where ranks still answer, kill the actors, release the bundles.
        Idempotent."""
        import ray

        actors, self._actors = self._actors, []
        if actors and ray.is_initialized():
            if not self._failed:
                closing = [a.close.remote() for a in actors]
                ray.wait(closing, num_returns=len(closing), timeout=5)  # behind a running call: kill
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception as e:
                    log.debug("ray.kill failed: %s", e)
            _wait_dead(actors, timeout_s=15.0)
        self._failed = self._failed or "shut down"
        if self._placement is not None:
            placement, self._placement = self._placement, None
            if ray.is_initialized():
                placement.release()

    def __enter__(self) -> "RayWorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"RayWorkerGroup({self.worker_cls.__name__}, name={self.name!r}, world_size={self.world_size}, "
                f"nodes={sorted(set(self.node_ips))})")


def _wait_dead(actors: list, timeout_s: float) -> None:
    """ray.kill only asks the GCS to kill: a call sent right after it can still run, and the
    process keeps its memory until the raylet reaps it. Poll each actor until a call on it fails
    (or the deadline passes), so the next group placed here finds the cores and memory free."""
    import ray

    deadline = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(a.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as e:                       # any other failure also means no answer
                log.debug("after ray.kill: %s", e)
                break
            time.sleep(0.05)
        else:
            log.warning("a killed actor still answered %.0f s after ray.kill", timeout_s)

