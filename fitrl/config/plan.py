"""The ``plan:`` section: what the memory planner reads beyond the run's own keys.

``fitrl plan`` predicts memory for a config; this section says which machines the prediction is
for (``plan.hardware``) and holds the what-if inputs fitrl has no run key for yet: a vLLM
rollout engine's memory settings (``plan.rollout``), which become ``rollout.*`` keys when the
vLLM engine lands. Images are no longer here: the planner reads the run's own ``data.max_pixels``
and ``data.limit_images`` (the loader names what replaced an old ``plan.images``).
``fitrl train`` reads ``plan.rollout`` and the rest, never ``plan.hardware``: it plans for the
hardware it detects. Field docstrings are what ``fitrl config --doc`` prints::

    plan:
      hardware: {nodes: 1, gpus_per_node: 8, gpu_memory: 80GiB, host_memory: 2TiB}
      rollout: {engine: vllm, gpu_memory_utilization: 0.6, tensor_parallel_size: 2, sleep_level: 1}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from fitrl.core.errors import ConfigError

UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: Any, what: str = "size") -> int:
    """``"80GiB"`` -> 85899345920, ``"2TB"`` -> 2e12, ``"251 GB"``, a plain number of bytes;
    anything else is a ConfigError naming ``what`` (the key or flag it came from)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{what}={text!r} is negative; write a size, e.g. 80GiB, 2TiB, 251GB")
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 80GiB, 2TiB, 251GB")
    try:
        return int(float(m.group(1)) * UNITS[m.group(2).lower()])
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 80GiB, 2TiB, 251GB") from None


@dataclass
class PlanHardwareConfig:
    nodes: Optional[int] = None
    """Nodes the plan is for (unset: ``trainer.nnodes``). ``fitrl plan --nodes`` overrides it; ``fitrl train`` ignores it."""
    gpus_per_node: Optional[int] = None
    """Devices (trainer ranks) per node; with ``device=cpu`` the rank processes per node (unset: ``trainer.devices_per_node``)."""
    gpu_memory: Any = None
    """Memory of one device: bytes or a size such as ``80GiB`` (unset: 80GiB; 0 with ``device=cpu``)."""
    host_memory: Any = None
    """RAM of one node: bytes or a size such as ``2TiB``, ``251GB`` (unset: 2TiB; this machine's RAM with ``device=cpu``)."""
    device: Optional[Literal["cuda", "cpu"]] = None
    """``cpu``: the plan of a CPU run, where every model state lives in host memory (unset: ``cpu`` when ``trainer.device=cpu``, else ``cuda``)."""

    def __post_init__(self) -> None:
        for name in ("gpu_memory", "host_memory"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), f"plan.hardware.{name}")
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"plan.hardware.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class PlanRolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: fitrl's engine today, transformers ``generate`` inside each trainer rank on the actor's own weights (gathered once per call under FSDP2). ``vllm``: a vLLM engine per ``tensor_parallel_size`` GPUs, colocated with the trainer ranks (planned, not in fitrl yet)."""
    gpu_memory_utilization: float = 0.6
    """vLLM: fraction of a device's memory the engine takes while awake (weights + KV cache + activations)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per engine."""
    sleep_level: Literal[0, 1, 2] = 1
    """vLLM between rollouts: 0 stays awake, 1 copies its weights to pinned host memory and frees the KV cache, 2 drops both (weights come back by weight sync)."""
    free_cache_engine: bool = False
    """Rebuild the engine's cache and host buffers every step (the behaviour of failure story 3): the old pinned host blocks stay cached, so host memory grows every rollout."""
    separate_processes: bool = False
    """Engines in their own processes (not sharing the trainer's): one more CUDA runtime each, and each loads the checkpoint on the host at start-up."""
    swap_space_gib: float = 0.0
    """vLLM ``swap_space``: pinned host KV blocks per engine in GiB (vLLM V0's default is 4)."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"plan.rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"plan.rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.swap_space_gib < 0:
            raise ConfigError(f"plan.rollout.swap_space_gib must be >= 0, got {self.swap_space_gib}")


@dataclass
class PlanConfig:
    hardware: PlanHardwareConfig = field(default_factory=PlanHardwareConfig)
    """The machines ``fitrl plan`` plans for (``--nodes``, ``--gpu-memory``, ... override it); ``fitrl train`` detects its own."""
    rollout: PlanRolloutConfig = field(default_factory=PlanRolloutConfig)
    """The rollout engine's memory settings, a what-if input until the vLLM engine lands."""
    steps: int = 0
    """Steps over which host memory growth is checked (0: ``trainer.max_steps``)."""
    object_store_fraction: float = 0.30
    """Ray's object store cap as a fraction of a node's RAM."""
    host_malloc: Literal["glibc", "mmap"] = "glibc"
    """The host allocator of CPU runs: ``glibc`` (default: its dynamic mmap threshold keeps freed activation-sized blocks in the heap, so RSS runs above live tensors and stays up after a phase) or ``mmap`` (processes started with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors are mapped and unmapped, RSS follows live tensors). Only CPU runs' host transients depend on it."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"plan.steps must be >= 0, got {self.steps}")
        if not 0 < self.object_store_fraction <= 1:
            raise ConfigError(f"plan.object_store_fraction must be in (0, 1], got {self.object_store_fraction}")
