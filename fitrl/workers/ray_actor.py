"""What runs inside each Ray actor of a worker group: one rank of one role.

:class:`RankActor` joins the role's process group, then builds the worker, so a worker's
``__init__`` may already use collectives (FSDP2, rank-0 loading); it runs the driver's calls
under the driver's phase (memory records, guard). :func:`remote` makes the Ray-decorated
versions on first use, so importing this module needs no ray.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from fitrl.core.faults import fault_point, identify
from fitrl.distributed.process_group import DistEnv, free_port, init_distributed
from fitrl.ops.sharing import SKIPPED_PROMPTS
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.phases import RECORDER
from fitrl.telemetry.progress import PROGRESS


class RankActor:
    """What runs in each Ray actor: join the process group, then build and serve the worker."""

    def __init__(self, role: str, env: DistEnv, backend: str, num_threads: int, dist_timeout_s: Optional[float],
                 worker_cls: type, args: tuple, kwargs: dict):
        import ray  # here, not at module level: see remote()

        self.role, self.rank = role, env.rank
        self.num_threads, self.device_index = num_threads, None
        self._bound = {threading.get_ident()}  # threads whose per-thread torch state is this rank's
        identify(role, env.rank)
        GUARD.process = f"{role}.rank{env.rank}"  # thresholds come from the worker's config
        self.node_ip = ray.util.get_node_ip_address()
        self.worker = None
        self.init_error: Optional[BaseException] = None
        # The failure is kept, not raised: a raising __init__ kills the actor, and its type would
        # reach the driver only as text. ready() re-raises it as a normal method error.
        try:
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
            torch.set_num_threads(num_threads)
            device_index = None
            if "nccl" in backend:
                # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, which is then device 0;
                # with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES every GPU stays visible.
                ids = ray.get_gpu_ids()
                device_index = self.device_index = int(ids[0]) if ids and torch.cuda.device_count() > 1 else 0
            init_distributed(env, backend, device_index=device_index, timeout_s=dist_timeout_s)
            self.worker = worker_cls(*args, rank=env.rank, world_size=env.world_size, **kwargs)
        except Exception as e:
            self.init_error = e

    def __repr__(self) -> str:  # Ray prints this in logs and errors
        return f"{self.role}[rank {self.rank}]"

    def ready(self) -> dict:
        if self.init_error is not None:
            raise self.init_error
        self._bind_thread()
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return {"node_ip": self.node_ip, "pid": os.getpid(), "device": device}

    def _bind_thread(self) -> None:
        """Ray runs this actor's calls on a thread of its own (the ``health`` concurrency group
        makes it a threaded actor), not the one ``__init__`` ran on: the per-thread state set
        there (torch's intra-op threads, which vLLM's CPU attention checks; the current CUDA
        device) is set again on a thread's first call."""
        ident = threading.get_ident()
        if ident in self._bound:
            return
        torch.set_num_threads(self.num_threads)
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)
        self._bound.add(ident)

    def call(self, method: str, args: tuple, kwargs: dict, phase: Optional[str] = None) -> Any:
        """Run a worker method; within a driver phase, record its memory and let the guard name it.
        An argument may be another group's result left in the object store (an ``ObjectRef``:
        :meth:`fitrl.workers.ray_group.RayWorkerGroup.call_kept`), fetched here, not by the driver."""
        import ray

        self._bind_thread()
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        if phase is None:
            return getattr(self.worker, method)(*args, **kwargs)
        GUARD.phase = phase
        PROGRESS.enter(phase)
        fault_point(phase)  # FITRL_INJECT_FAULT, for the tests of hangs and restarts
        try:
            with RECORDER.phase(phase), SKIPPED_PROMPTS.during(phase):
                return getattr(self.worker, method)(*args, **kwargs)
        finally:
            GUARD.phase = None
            PROGRESS.enter(None)
            GUARD.note()  # a crossing no safe point acted on (an update) waits for the step's end

    def call_kept(self, method: str, args: tuple, kwargs: dict, phase: Optional[str] = None) -> list:
        """``call``, its result put in the object store by this process; the handle comes back in a
        list (so the driver receives the handle, not the value)."""
        import ray

        return [ray.put(self.call(method, args, kwargs, phase))]

    def health(self) -> dict:
        """This rank's phase, seconds since its last heartbeat and its main thread's stack. Called
        in the ``health`` concurrency group (a thread of its own: it answers while ``call`` is stuck)."""
        return {**PROGRESS.report(), "role": self.role, "rank": self.rank, "pid": os.getpid(), "node_ip": self.node_ip,
                "collectives": collectives_issued()}

    def skipped_prompts(self) -> dict[str, list[int]]:
        """The prompt copies this rank's passes did not run since the last call (fitrl/ops/sharing.py)."""
        return SKIPPED_PROMPTS.drain()

    def memory_report(self) -> tuple[dict, Any]:
        """This rank's per-phase memory since the last report, and a guard crossing left to act on."""
        return RECORDER.drain(), GUARD.take_deferred()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def collectives_issued() -> Optional[int]:
    """Collectives this process has issued on all its process groups (the sum of c10d's per-group,
    per-backend sequence numbers; None before the group exists). The watchdog compares the ranks'
    counts: an NCCL collective returns at enqueue, so the count, not the stack, shows a rank
    that has entered a collective its peers have not (fitrl/trainer/watchdog.py)."""
    if not dist.is_initialized():
        return None
    total = 0
    try:
        for group in list(dist.distributed_c10d._world.pg_map):
            # a backend per device type ("cpu:gloo,cuda:nccl"), each with its own count; plain
            # "gloo" serves both device types with one backend, counted once
            backends = {id(b): b for b in (group._get_backend(d) for d in group._device_types)}
            total += sum(b._get_sequence_number_for_group() for b in backends.values())
    except (AttributeError, RuntimeError):  # a torch without them, or a group being torn down
        return None
    return total


_REMOTE: dict[str, Any] = {}


def remote(name: str):
    """Ray-decorated objects, made on first use so that importing this module needs no ray."""
    if not _REMOTE:
        import ray

        # "health": a thread of its own for RankActor.health, so a stuck rank still says where it is;
        # "mailbox": one for short calls beside a running one (a rollout worker's incoming weights)
        _REMOTE["actor"] = ray.remote(max_restarts=0, max_task_retries=0,
                                      concurrency_groups={"health": 1, "mailbox": 1})(RankActor)
        _REMOTE["port"] = ray.remote(num_cpus=0, max_retries=0)(free_port)
    return _REMOTE[name]

