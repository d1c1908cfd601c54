"""What the planner reads: the run's config, the hardware, and planner-only inputs.

A config file for ``fitrl plan`` is a normal fitrl config that may carry a ``plan:`` section
(and ``plan.*`` dotted overrides) for what fitrl's schema has no field for yet: the hardware
the plan is for, the rollout engine's memory settings (vLLM), images. The section is removed
before the rest is validated by :func:`fitrl.config.load_config`, so every fitrl key keeps its
checks and messages::

    plan:
      hardware: {nodes: 1, gpus_per_node: 8, gpu_memory: 80GiB, host_memory: 2TiB}
      rollout: {engine: vllm, gpu_memory_utilization: 0.6, tensor_parallel_size: 2, sleep_level: 1}
      images: {per_prompt: 1, max_pixels: 4194304}
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import yaml

from fitrl.config import ConfigError, FitrlConfig, load_config

UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: Any, what: str = "size") -> int:
    """``"80GiB"`` -> 85899345920, ``"2TB"`` -> 2e12, ``"251 GB"``, a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 80GiB, 2TiB, 251GB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


@dataclass
class Hardware:
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """Devices (trainer ranks) per node; on ``device=cpu`` the rank processes per node."""
    gpu_memory: Any = "80GiB"
    """Memory of one device (ignored for ``device=cpu``)."""
    host_memory: Any = "2TiB"
    """RAM of one node."""
    device: Literal["cuda", "cpu"] = "cuda"
    """``cpu``: the plan of a CPU run, where every model state lives in host memory."""

    def __post_init__(self) -> None:
        self.gpu_memory = parse_bytes(self.gpu_memory, "plan.hardware.gpu_memory")
        self.host_memory = parse_bytes(self.host_memory, "plan.hardware.host_memory")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError("plan.hardware.nodes and gpus_per_node must be >= 1")

    @classmethod
    def cpu(cls, ranks_per_node: int = 1, host_memory: Optional[int] = None) -> "Hardware":
        """This machine as a CPU run (host memory read from the OS unless given)."""
        if host_memory is None:
            host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(nodes=1, gpus_per_node=ranks_per_node, gpu_memory=0, host_memory=host_memory, device="cpu")


@dataclass
class RolloutEngine:
    engine: Literal["hf", "vllm"] = "hf"
    """``hf``: fitrl's engine today, transformers ``generate`` inside each trainer rank on the
    actor's own weights (gathered once per call under FSDP2). ``vllm``: a vLLM engine per
    ``tensor_parallel_size`` GPUs, colocated with the trainer ranks (planned, not in fitrl yet)."""
    gpu_memory_utilization: float = 0.6
    """vLLM: fraction of a device's memory the engine takes while awake (weights + KV cache + activations)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per engine."""
    sleep_level: int = 1
    """vLLM between rollouts: 0 stays awake, 1 copies its weights to pinned host memory and frees the KV
    cache, 2 drops both (weights come back by weight sync)."""
    free_cache_engine: bool = False
    """The anchors' ``free_cache_engine``: the engine's cache and host buffers are rebuilt each step
    and the old pinned host blocks stay cached, so host memory grows every rollout (DESIGN §1 story 3)."""
    separate_processes: bool = False
    """Engines in their own processes (not sharing the trainer's): one more CUDA runtime each, and
    each loads the checkpoint on the host at start-up."""
    swap_space_gib: float = 0.0
    """vLLM ``swap_space``: pinned host KV blocks per engine (vLLM V0 default 4)."""


@dataclass
class Images:
    per_prompt: float = 0.0
    """Images per prompt (0: a text-only run)."""
    max_pixels: int = 4194304
    """The processor resizes larger images down to this many pixels (proposed ``data.max_pixels``)."""
    pixels: int = 0
    """Pixels of a typical image after resizing (0: ``max_pixels``, the worst case)."""

    @property
    def effective_pixels(self) -> int:
        return min(self.pixels or self.max_pixels, self.max_pixels)


@dataclass
class PlanInputs:
    hardware: Hardware = field(default_factory=Hardware)
    rollout: RolloutEngine = field(default_factory=RolloutEngine)
    images: Images = field(default_factory=Images)
    steps: int = 0
    """Steps over which host growth is checked (0: ``trainer.max_steps``)."""
    object_store_fraction: float = 0.30
    """Ray's object store cap as a fraction of a node's RAM."""
    host_malloc: Literal["glibc", "mmap"] = "glibc"
    """The host allocator of CPU runs: ``glibc`` (default: its dynamic mmap threshold keeps freed
    activation-sized blocks in the heap, so RSS runs above live tensors and stays up after a
    phase) or ``mmap`` (processes started with ``MALLOC_MMAP_THRESHOLD_=65536``: tensors are
    mapped and unmapped, RSS follows live tensors). Only CPU runs' host transients depend on it."""


def plan_inputs_from_dict(data: dict[str, Any]) -> PlanInputs:
    """Build :class:`PlanInputs` from the ``plan:`` section, rejecting unknown keys."""
    def build(cls, value, prefix):
        if not isinstance(value, dict):
            raise ConfigError(f"{prefix} must be a mapping, got {value!r}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in value.items():
            if k not in names:
                raise ConfigError(f"unknown planner key '{prefix}.{k}'; valid: {', '.join(names)}")
            sub = {Hardware: Hardware, RolloutEngine: RolloutEngine, Images: Images}.get(
                names[k].default_factory if names[k].default_factory is not dataclasses.MISSING else None)
            kwargs[k] = build(sub, v, f"{prefix}.{k}") if sub else v
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"{prefix}: {e}") from None
    return build(PlanInputs, data or {}, "plan")


def load_plan_config(path: Optional[str], overrides: Sequence[str] = ()) -> tuple[FitrlConfig, dict[str, Any]]:
    """The validated fitrl config and the raw ``plan`` section (the file's, then ``plan.*`` overrides)."""
    plan = (_plan_section(path) or {}) if path else {}
    fitrl_over = [o for o in overrides if not o.strip().startswith("plan.")]
    for item in [o for o in overrides if o.strip().startswith("plan.")]:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like key=value")
        node = plan
        parts = key.strip().split(".")[1:]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(text)
    cfg = _load_without_plan(path, fitrl_over) if path and _plan_section(path) is not None \
        else load_config(path, fitrl_over)
    return cfg, plan


def _plan_section(path: str) -> Optional[dict]:
    """The top file's ``plan:`` section ({} when empty), None when it has none (only the file
    given on the command line may carry one; a ``base:`` file is plain fitrl config)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None  # load_config reports it
    if not isinstance(data, dict) or "plan" not in data:
        return None
    return dict(data["plan"] or {})


def _load_without_plan(path: str, overrides: Sequence[str]) -> FitrlConfig:
    """load_config on a copy of ``path`` without its ``plan:`` section (its ``base:`` made absolute)."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data.pop("plan", None)
    if isinstance(data.get("base"), str):
        data["base"] = os.path.abspath(os.path.join(os.path.dirname(path), data["base"]))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(data, f)
        tmp = f.name
    try:
        return load_config(tmp, overrides)
    except ConfigError as e:
        raise ConfigError(str(e).replace(tmp, path)) from None
    finally:
        os.unlink(tmp)
