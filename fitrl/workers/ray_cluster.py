"""The driver's side of a Ray cluster: joining it (or starting a private one) with every wait
bounded, waiting on it so that a signal still lands, and what it asks the cluster about its
devices without touching CUDA in its own process (fitrl/core/device.py): the ``GPU`` count of
its nodes, and one GPU's name and memory read by a short-lived Ray task that holds it.
Re-exported by :mod:`fitrl.workers.ray_group`."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

from fitrl.core.device import ClusterDevices, GPUFacts
from fitrl.core.errors import ClusterError

CONNECT_PROBE_S = 5.0
"""How long a TCP connect to the cluster's address may take before the address is judged not to
answer (``ray.init`` itself would retry for many minutes: 20 tries of about 40 s)."""


WAIT_SLICE_S = 1.0
"""The longest single ``ray.wait`` of :func:`wait`: a signal lands within it."""

STARTED_HERE: dict[str, Optional[bool]] = {"value": None}
"""Whether this process started its Ray cluster (no node can join it: a placement it cannot give
is refused at once) or joined one (nodes may still join); None: connected by someone else."""


def ensure_ray(address: Optional[str] = None, num_cpus: Optional[int] = None,
               runtime_env: Optional[dict] = None, key: str = "trainer.ray_address") -> None:
    """Connect Ray once per process.

    ``address`` (or ``RAY_ADDRESS``) joins a running cluster: ``"auto"`` for the one started by
    ``ray start`` on this machine, ``"HOST:6379"`` for another; an address that does not answer
    is a :class:`ClusterError` naming it (``key``: the setting it came from) and the fix, within
    :data:`CONNECT_PROBE_S` where nothing listens, at once for a refused auth token, in about
    40 s where something else listens. Without either, a private local cluster starts
    (``num_cpus`` logical CPUs, default: all; dashboard off). A second call is a no-op, whatever
    its arguments.
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from air-gapped nodes
    if not address and os.environ.get("RAY_ADDRESS"):
        address, key = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    common = dict(logging_level=logging.WARNING, runtime_env=runtime_env)
    if address and address != "local":
        if num_cpus is not None:
            raise ValueError(f"num_cpus={num_cpus} applies to a local cluster; the cluster at {address!r} "
                             "has its resources set by `ray start`")
        target = probe_address(address, key)
        if not address.startswith("ray://"):
            probe_gcs(address, key, target)
        try:
            ray.init(address=address, **common)
        except Exception as e:  # (ConnectionError, AuthenticationError, Ray's RuntimeError)
            raise join_error(address, key, target, e) from None
        STARTED_HERE["value"] = False
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **common)
        STARTED_HERE["value"] = True


def probe_address(address: str, key: str = "trainer.ray_address") -> str:
    """The ``host:port`` Ray would join for ``address``, once a TCP connect to it succeeded."""
    fix = ("start the cluster (`ray start --head --port=6379` on its head node) or give the address `ray status` "
           "prints there (HOST:PORT, default port 6379)")
    if address.startswith("ray://"):  # Ray Client: its server's port (10001 by default)
        rest = address[len("ray://"):]
        target = rest if ":" in rest else f"{rest}:10001"
    else:
        from ray._private.services import canonicalize_bootstrap_address

        try:  # "auto": RAY_ADDRESS, else the latest `ray start` on this machine
            target = canonicalize_bootstrap_address(address)
        except ConnectionError:
            raise ClusterError(f"{key}={address}: no Ray cluster was started on this machine; {fix}") from None
        except ValueError:
            raise ClusterError(f"{key}={address}: not HOST:PORT (e.g. 10.0.0.1:6379), auto or local") from None
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_PROBE_S).close()
    except ValueError:
        raise ClusterError(f"{key}={address}: not HOST:PORT (e.g. 10.0.0.1:6379), auto or local") from None
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ClusterError(f"{key}={address}: nothing answers at {target} ({why} within {CONNECT_PROBE_S:.0f} s); "
                           f"{fix}") from None
    return target


def probe_gcs(address: str, key: str, target: str) -> None:
    """One try of Ray's client of the cluster's GCS: a wrong or missing auth token answers at once
    (``ray.init`` would only say "Failed to connect"), an address where something else listens
    in about 40 s (``ray.init`` would retry 20 times)."""
    try:
        from ray._raylet import GcsClient  # (what ray.init itself connects with)
    except ImportError:  # another Ray: ray.init's own wait
        return
    try:
        GcsClient(address=target)
    except Exception as e:
        raise join_error(address, key, target, e) from None


def join_error(address: str, key: str, target: str, e: Exception) -> ClusterError:
    """``ray.init`` failed although the address answers: its token, or not a Ray cluster there."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:300]
    if type(e).__name__ == "AuthenticationError" or "authentication" in str(e).lower():
        first = first.split(". ")[0]  # (Ray's advice that follows is the same as ours)
        return ClusterError(f"{key}={address}: the cluster at {target} refused this process's Ray auth token "
                            f"({first}); copy the head node's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN or "
                            "RAY_AUTH_TOKEN_PATH to it (docs/distributed.md, 'Joining a cluster')")
    return ClusterError(f"{key}={address}: something answers at {target} but Ray could not join a cluster there "
                        f"({type(e).__name__}: {first}); give the address `ray status` prints on the head node "
                        "(default port 6379), with the same Ray version on every node")


def wait(refs: list, num_returns: int, timeout_s: float) -> tuple[list, list]:
    """``ray.wait`` in slices of at most :data:`WAIT_SLICE_S`. A signal handler that raises
    (SIGTERM's, fitrl/trainer/signals.py) inside Ray's C++ wait comes back as a ``SystemError``
    only after the whole wait; between slices it lands at once, and one raised inside a slice is
    raised as itself."""
    import ray

    end = time.monotonic() + max(0.0, timeout_s)
    while True:
        left = max(0.0, end - time.monotonic())
        try:
            done, rest = ray.wait(refs, num_returns=num_returns, timeout=min(WAIT_SLICE_S, left))
        except SystemError as e:
            if isinstance(e.__cause__, BaseException) and not isinstance(e.__cause__, Exception):
                raise e.__cause__ from None
            raise
        if len(done) >= num_returns or left <= WAIT_SLICE_S:
            return done, rest

PROBE_TIMEOUT_S = 120.0
"""How long the driver waits for a GPU of the cluster to read its memory (a busy shared cluster)."""


def cluster_devices(timeout_s: float = PROBE_TIMEOUT_S) -> ClusterDevices:
    """The connected cluster's devices as the driver sees them, without touching CUDA in this
    process: the ``GPU`` count of its nodes, and one GPU's facts probed on demand."""
    import ray

    return ClusterDevices(gpus=int(ray.cluster_resources().get("GPU", 0)), probe=lambda: probe_gpu(timeout_s))


def read_gpu() -> GPUFacts:
    """In a process holding one GPU (``CUDA_VISIBLE_DEVICES`` set by Ray): its name and memory,
    and its node's RAM."""
    import psutil
    import torch

    props = torch.cuda.get_device_properties(0)
    return GPUFacts(name=props.name, memory=props.total_memory, host_memory=psutil.virtual_memory().total)


def probe_gpu(timeout_s: float = PROBE_TIMEOUT_S) -> GPUFacts:
    """:func:`read_gpu` in a Ray task holding one of the cluster's GPUs. ``max_calls=1``: the
    worker process exits after it, taking whatever CUDA made there with it, so nothing stays on
    the GPU a rank will use."""
    import ray

    task = ray.remote(num_cpus=0, num_gpus=1, max_calls=1, max_retries=0)(read_gpu)
    ref = task.remote()
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise TimeoutError(f"no GPU of the Ray cluster came free in {timeout_s:.0f} s to read its memory") from None
