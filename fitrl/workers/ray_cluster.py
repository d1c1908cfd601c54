"""What the driver asks a connected Ray cluster about its devices, without touching CUDA in its
own process (fitrl/core/device.py): the ``GPU`` count of its nodes, and one GPU's name and memory
read by a short-lived Ray task that holds it. Re-exported by :mod:`fitrl.workers.ray_group`."""

from __future__ import annotations

from fitrl.core.device import ClusterDevices, GPUFacts

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
