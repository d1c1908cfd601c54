"""The ``plan:`` section: what the memory planner reads beyond the run's own keys.

``fitrl plan`` predicts memory for a config; this section says which machines the prediction is
for (``plan.hardware``) and holds what the planner alone reads: behaviours of another
framework (its vLLM integration, its checkpoint loading) that fitrl never has (``plan.emulate``), kept to reproduce
the failure stories' reported runs; and the lengths a typical step has
(``plan.expected_prompt_length``, ``plan.expected_response_length``), for the plan at expected
lengths beside the one at the caps. The rollout engine itself is planned from the run's own keys
(``rollout.engine``, ``rollout.gpu_memory_utilization``, ``rollout.kv_cache_memory``,
``rollout.tensor_parallel_size``, ``rollout.sleep_level``), and images from ``data.max_pixels``
and ``data.limit_images`` (the loader names what replaced an old ``plan.rollout`` or
``plan.images`` key). ``fitrl train``'s plan reads ``plan.emulate`` and the rest, never
``plan.hardware``: it plans for the hardware it detects. Field docstrings are what
``fitrl config --doc`` prints::

    rollout: {engine: vllm, gpu_memory_utilization: 0.6, tensor_parallel_size: 2, sleep_level: 1}
    plan:
      hardware: {nodes: 1, gpus_per_node: 8, gpu_memory: 80GiB, host_memory: 2TiB}
      emulate: {free_cache_engine: true, swap_space_gib: 4}
      expected_prompt_length: auto      # or tokens, or null: the cap
      expected_response_length: 400     # null: rollout.max_response_length
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
class PlanEmulateConfig:
    """Behaviours of another framework (its vLLM integration, its checkpoint loading), to reproduce
    a reported run in the plan (examples/failure_stories/); fitrl never does any of them. Only the
    planner reads them (``fitrl plan``, and ``fitrl train``'s plan before the run), the engine's
    with ``rollout.engine=vllm``; training itself never does."""
    free_cache_engine: bool = False
    """Another framework's vLLM integration, emulated to reproduce a reported run (fitrl's own engine never does this; only the planner reads it, with ``rollout.engine=vllm``): the engine frees and rebuilds its cache and host buffers every step instead of sleeping (failure story 3): the old pinned host blocks stay cached, so host memory grows every rollout."""
    separate_processes: bool = False
    """Another framework's vLLM integration, emulated to reproduce a reported run (fitrl's own engine never does this; only the planner reads it, with ``rollout.engine=vllm``): engines in processes of their own instead of inside the trainer ranks: one more CUDA runtime each, and each loads the checkpoint on the host at start-up (failure story 2)."""
    swap_space_gib: float = 0.0
    """Another framework's vLLM integration, emulated to reproduce a reported run (fitrl's own engine never does this; only the planner reads it, with ``rollout.engine=vllm``): vLLM V0's ``swap_space``, pinned host KV blocks per GPU in GiB (every tensor-parallel worker holds its own) (V0's default was 4; failure story 3)."""
    load_on_device: bool = False
    """Another framework's checkpoint loading, emulated to reproduce a reported run (fitrl never does this; only the planner reads it, with ``trainer.backend=ray`` on CUDA and ``actor.fsdp.init=every_rank``): every rank loads the whole checkpoint onto its own device, in the actor's dtype, before sharding it, instead of reading it into host memory (EasyR1 without ``enable_rank0_init``: ``from_pretrained(device_map="cuda")`` on every rank; failure story 5). With ``init=rank0`` it changes nothing: rank 0 reads into host memory, as EasyR1's rank-0 path does."""

    def __post_init__(self) -> None:
        if not self.swap_space_gib >= 0:
            raise ConfigError(f"plan.emulate.swap_space_gib must be >= 0, got {self.swap_space_gib}")


@dataclass
class PlanConfig:
    hardware: PlanHardwareConfig = field(default_factory=PlanHardwareConfig)
    """The machines ``fitrl plan`` plans for (``--nodes``, ``--gpu-memory``, ... override it); ``fitrl train`` detects its own."""
    emulate: PlanEmulateConfig = field(default_factory=PlanEmulateConfig)
    """Behaviours of another framework (its vLLM integration, its checkpoint loading) that fitrl never has, to reproduce a reported run (the failure stories); the engine's own settings are ``rollout.*`` keys."""
    steps: int = 0
    """Steps over which host memory growth is checked (0: ``trainer.max_steps``)."""
    object_store_fraction: float = 0.30
    """Ray's object store cap as a fraction of a node's RAM."""
    expected_prompt_length: Any = "auto"
    """The prompt length a typical step's batches are padded to, for the plan at expected lengths (the verdict rule: docs/architecture.md, "Memory model"): ``auto`` (default) reads it from ``data.train_files``: the longest of the first 1,000 prompts, tokenised as the run builds them (a batch's prompts are left-padded to its longest; with hundreds per step that is near the data's longest), or the cap when the files or the tokenizer cannot be read here (the plan says so in a note); a number of tokens; or ``null``: ``data.max_prompt_length``. At most ``data.max_prompt_length``."""
    expected_response_length: Optional[int] = None
    """The response length a typical micro-batch is padded to (its longest response), for the plan at expected lengths: a number of tokens, or ``null`` (default): ``rollout.max_response_length`` (no typical length is known before the run). At most ``rollout.max_response_length``. What is allocated at the cap whatever the lengths (HF generate's KV cache for ``max_response_length`` tokens, a vLLM engine's share) stays at the cap."""
    host_malloc: Literal["glibc", "mmap"] = "glibc"
    """The host allocator of CPU runs: ``glibc`` (default: its dynamic mmap threshold keeps freed activation-sized blocks in the heap, so RSS runs above live tensors and stays up after a phase) or ``mmap`` (processes started with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors are mapped and unmapped, RSS follows live tensors). Only CPU runs' host transients depend on it; under ``memory.host_allocator`` jemalloc or tcmalloc the plan counts live tensors, with that allocator's measured caches (fitrl/memory/calibration.py) and a group's shared prompt run once."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"plan.steps must be >= 0, got {self.steps}")
        p = self.expected_prompt_length
        if p not in ("auto", None) and not (isinstance(p, int) and not isinstance(p, bool) and p >= 1):
            raise ConfigError(f"plan.expected_prompt_length={p!r}: use auto (read from data.train_files), a number "
                              f"of tokens >= 1, or null (data.max_prompt_length)")
        r = self.expected_response_length
        if r is not None and r < 1:
            raise ConfigError(f"plan.expected_response_length={r!r}: use a number of tokens >= 1, or null "
                              f"(rollout.max_response_length)")
        if not 0 < self.object_store_fraction <= 1:
            raise ConfigError(f"plan.object_store_fraction must be in (0, 1], got {self.object_store_fraction}")
