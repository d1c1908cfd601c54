"""The planner's types: the hardware a plan is for, memory by component per process and phase,
and the plan with its verdict (a run's derived numbers and its roles' states: :mod:`.run`).

Processes: ``trainer`` (one per device: the policy's shard and the rollout engine in the same
process: the HF engine, or vLLM's on CPU; in one process, the in-process backend, the reference
and the critic too), ``ref`` and ``critic`` (under Ray the reference's and the critic's ranks are
Ray actors of their own, one per device on the policy's bundle: :func:`.roles.process_roles`),
``engine`` (a vLLM engine on CUDA, ``rollout.engine=vllm``: host entries per engine, device
entries per device), ``driver`` (node 0), ``node`` (what belongs to no rank: Ray, the object
store, reward workers) and ``rank0`` (rank 0's extra load and save copies). Phases follow one RL step plus load,
validation and checkpoint save; the plan is the steady state (from step 2: AdamW states exist;
gradients only inside the update, which frees them after its last optimizer step), and a phase's
peak is the sum of what is resident in it and its largest transient. A node's host peak sums its
processes; a device's peak sums what shares it (trainer, reference and critic ranks, engine). See
docs/architecture.md, "Memory model".

The phase modules (:mod:`.trainer`, :mod:`.services`) build :class:`ProcessPlan` objects from a
:class:`fitrl.memory.run.Run`; :func:`fitrl.planner.plan.plan_config` composes them into a
:class:`Plan`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from fitrl.config import ConfigError, FitrlConfig
from fitrl.config.layout import RunLayout
from fitrl.config.plan import parse_bytes
from fitrl.memory import calibration as C
from fitrl.memory.lengths import Lengths
from fitrl.models.shape import ModelShape

if TYPE_CHECKING:  # fitrl.algo imports torch; the planner only holds its spec
    from fitrl.algo import AlgorithmSpec

PHASES = ("load", "rollout", "reward", "weight_sync", "old_logprob", "ref_logprob", "teacher_logprob", "update",
          "validation", "checkpoint_save")
ACTOR_PHASES = {"rollout", "weight_sync", "old_logprob", "update", "validation", "checkpoint_save"}
ROLE_PHASES = {"teacher_logprob": "teacher"}
"""Phases a step has only in a run that builds the role named (fitrl/config/layout.py): the
processes' tables list every other phase whatever the run, these only where the role is built."""


def listed_phases(layout: RunLayout) -> tuple[str, ...]:
    """:data:`PHASES` less those of :data:`ROLE_PHASES` whose role ``layout`` does not build."""
    return tuple(ph for ph in PHASES if ph not in ROLE_PHASES or layout.builds(ROLE_PHASES[ph]))


DEVICE_KINDS = ("trainer", "engine")
"""Process kinds with one process per device whatever the run (the trainer rank, a vLLM engine);
what a plan reads is each process's own :attr:`ProcessPlan.per_device`, set where it is planned."""


def machine_ram() -> int:
    """This machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Hardware:
    """The machines a plan is for, resolved to counts and bytes."""
    nodes: int = 1
    gpus_per_node: int = 8             # devices (trainer ranks) per node; on ``device=cpu`` rank processes
    gpu_memory: int = 80 * C.GIB       # one device's memory (0 on ``device=cpu``)
    host_memory: int = 2 * 1024 * C.GIB  # one node's RAM
    device: str = "cuda"               # "cuda" | "cpu"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"a plan needs nodes >= 1 and GPUs per node >= 1, got {self.nodes} and "
                              f"{self.gpus_per_node}")

    @classmethod
    def cpu(cls, ranks_per_node: int = 1, host_memory: Optional[int] = None) -> "Hardware":
        """This machine as a CPU run (host memory read from the OS unless given)."""
        return cls(nodes=1, gpus_per_node=ranks_per_node, gpu_memory=0,
                   host_memory=machine_ram() if host_memory is None else host_memory, device="cpu")

    @classmethod
    def for_config(cls, cfg: FitrlConfig, *, nodes: Optional[int] = None, gpus_per_node: Optional[int] = None,
                   gpu_memory: Optional[int] = None, host_memory: Optional[int] = None,
                   device: Optional[str] = None) -> "Hardware":
        """``cfg.plan.hardware`` with the given values (``fitrl plan``'s flags) over it; what both
        leave unset comes from ``trainer.*`` (nodes, devices per node, ``trainer.device=cpu``), else
        80 GiB devices and 2 TiB nodes, or for a CPU run no device memory and this machine's RAM."""
        h = cfg.plan.hardware
        device = _first(device, h.device, "cpu" if cfg.trainer.device == "cpu" else "cuda")
        if gpu_memory is None and h.gpu_memory is not None:
            gpu_memory = parse_bytes(h.gpu_memory, "plan.hardware.gpu_memory")
        if host_memory is None and h.host_memory is not None:
            host_memory = parse_bytes(h.host_memory, "plan.hardware.host_memory")
        cpu = device == "cpu"
        return cls(nodes=_first(nodes, h.nodes, cfg.trainer.nnodes),
                   gpus_per_node=_first(gpus_per_node, h.gpus_per_node, cfg.trainer.devices_per_node),
                   gpu_memory=_first(gpu_memory, 0 if cpu else 80 * C.GIB),
                   host_memory=_first(host_memory, machine_ram() if cpu else 2 * 1024 * C.GIB), device=device)


def _first(*values):
    """The first value that is set (not None)."""
    return next(v for v in values if v is not None)


@dataclass
class Usage:
    gpu: dict[str, int] = field(default_factory=dict)   # component -> bytes on one device
    host: dict[str, int] = field(default_factory=dict)  # component -> bytes of host memory

    def add(self, where: str, component: str, nbytes: float) -> None:
        if nbytes > 0:
            d = self.gpu if where == "gpu" else self.host
            d[component] = d.get(component, 0) + int(nbytes)


@dataclass
class ProcessPlan:
    kind: str
    per_node: int                      # processes of this kind on the busiest node
    phases: dict[str, Usage]
    per_device: bool = False
    """One process per device, so its device entries are that device's: the trainer rank, a vLLM
    engine, and under Ray a role's ranks of their own (set by the planner of the process:
    fitrl/memory/trainer.py from the role's planner, an engine's planner for its processes)."""
    own_device: bool = False
    """Its processes sit on devices of their own, not the trainer ranks' (rollout workers under
    Ray, :attr:`fitrl.memory.roles.RolePlanner.own_device`): a device's peak is then theirs alone."""

    def host_peak(self, phase: Optional[str] = None) -> int:
        return max(sum(self.phases[p].host.values()) for p in ([phase] if phase else self.phases))

    def gpu_peak(self, phase: Optional[str] = None) -> int:
        return max(sum(self.phases[p].gpu.values()) for p in ([phase] if phase else self.phases))


@dataclass
class Problem:
    resource: str      # "gpu" | "host"
    phase: str
    need: int          # the predicted peak (the middle of its band)
    limit: int         # what the run may use (Plan.gpu_limit / host_limit)
    step: int = 0      # > 0: reached only at this step (host growth)
    at: str = "caps"   # the lengths of the plan it is in: "caps" | "expected"
    band: float = 0.0  # the plan's error band for the resource (a fraction of ``need``)
    call: str = "does not fit"  # "does not fit" (over even at the band's low end) | "tight"

    @property
    def short(self) -> int:
        """Bytes the peak must come down by for the verdict to be ``fits`` (its band's top at the limit)."""
        return int(self.need * (1 + self.band)) - self.limit


def _on_node_0(p: ProcessPlan) -> int:
    """How many processes of ``p``'s kind node 0 holds (one driver, one set of node services, one
    rank 0's extra copies; of the others their count per node)."""
    return 1 if p.kind in ("driver", "node", "rank0") else p.per_node


def _cpu_host_bands(allocator: str) -> tuple[dict, str]:
    """A CPU process kind's measured host bands under ``allocator`` and what measured them."""
    if allocator == "glibc":
        return C.CPU_HOST_BANDS, "measured: held-out CPU corpus, Ray ranks"
    return C.CPU_HOST_BANDS_BY_ALLOCATOR.get(allocator, {}), f"measured: held-out CPU corpus under {allocator}"


_KIND_NAMES = {"node": "Ray's services and the reward and tool workers", "rollout": "rollout workers",
               "engine": "the rollout engine's process"}
"""How :meth:`Plan.band` names the process kinds it has no measured band for."""


@dataclass
class Plan:
    """A run's memory per process and phase, at the caps, with the plan at expected lengths in
    :attr:`expected` (None when they are the caps) and the verdict (docs/architecture.md,
    "Memory model"). Each predicted peak carries the plan's error band for its resource
    (:meth:`band`: measured where a calibration covers the run, else a wider one marked assumed),
    and is held against what the run may use before fitrl's guard stops it (:attr:`gpu_limit`,
    :attr:`host_limit`):

    - ``fits``: every peak, at the top of its band, is within the limit;
    - ``does not fit``: some peak, even at the bottom of its band, is over it;
    - ``tight``: in between. Where expected lengths are planned, the verdict is theirs, and a
      peak at the caps over the limit makes it at most ``tight`` (a step of only capped
      sequences is rare; the guard stops it cleanly if it comes).

    :attr:`fits` is true for ``fits`` and ``tight``: ``fitrl train`` proceeds on both (warned on
    ``tight``), and ``fitrl plan`` exits 1 only on ``does not fit``. :meth:`problems` lists what
    keeps the verdict from ``fits``."""
    cfg: FitrlConfig
    hardware: Hardware
    shape: ModelShape
    spec: AlgorithmSpec                # the roles the algorithm builds (critic, reference)
    phases: list[str]                  # the phases the run has (fitrl/memory/engines.py, ``active_phases``)
    processes: list[ProcessPlan]
    notes: list[str]
    growth_per_step: int = 0           # host bytes per node added every step (anchor behaviours)
    lengths: Optional[Lengths] = None  # the expected lengths and where they came from (None: the caps)
    expected: Optional["Plan"] = None  # the plan at ``lengths``; None when they are the caps
    at: str = "caps"                   # this plan's lengths: "caps" | "expected"
    layout: Optional[RunLayout] = None  # the roles and processes planned (fitrl/config/layout.py)

    def process(self, kind: str) -> ProcessPlan:
        return next(p for p in self.processes if p.kind == kind)

    def device(self, phase: str) -> dict[str, int]:
        """One device's memory in ``phase``: everything that shares it, by component: one process
        of each per-device kind (:attr:`ProcessPlan.per_device`: the trainer rank, under Ray the
        reference and critic ranks on its bundle, the engine). The engine's entries are per device
        already: a vLLM engine with tensor parallelism takes ``gpu_memory_utilization`` of every
        device in its group, not 1/tp of it. Processes on devices of their own
        (:attr:`ProcessPlan.own_device`) are not
        on it: :meth:`peaks` takes theirs apart. The driver's device entries (its CUDA context,
        which would sit on GPU 0 of node 0: fitrl/memory/gpu_terms.py) count on it too, and so
        do rank 0's (its weight-channel bucket: fitrl/memory/services.py): the device planned is
        the fullest one."""
        out: dict[str, int] = {}
        for p in self.processes:
            on_it = (p.per_device and not p.own_device) or p.kind in ("driver", "rank0")
            if on_it and phase in p.phases:
                for k, v in p.phases[phase].gpu.items():
                    out[k] = out.get(k, 0) + v
        return out

    def node_host(self, phase: str) -> dict[str, int]:
        """Node 0's host memory in ``phase`` (rank 0, the driver and Ray's head live there)."""
        out: dict[str, int] = {}
        for p in self.processes:
            if phase in p.phases:
                for k, v in p.phases[phase].host.items():
                    out[k] = out.get(k, 0) + v * _on_node_0(p)
        return out

    def peaks(self) -> dict[str, tuple[int, int]]:
        """Per phase: (the fullest device's bytes, node 0's host bytes)."""
        def fullest(ph: str) -> int:
            alone = [p.gpu_peak(ph) for p in self.processes if p.own_device and ph in p.phases]
            return max([sum(self.device(ph).values())] + alone)
        return {ph: (fullest(ph), sum(self.node_host(ph).values())) for ph in self.phases}

    @property
    def gpu_limit(self) -> int:
        """What one device may hold: the guard's ceiling (``memory.guard_gpu_max_fraction``, 97 %)."""
        return int(self.hardware.gpu_memory * self.cfg.memory.guard_gpu_max_fraction)

    @property
    def host_limit(self) -> int:
        """What a node's processes may hold: its RAM less what the guard keeps available
        (``memory.guard_min_available_gib``, else ``guard_min_available_fraction``: 7 %)."""
        m, ram = self.cfg.memory, self.hardware.host_memory
        keep = m.guard_min_available_gib * C.GIB if m.guard_min_available_gib is not None else \
            m.guard_min_available_fraction * ram
        return int(ram - min(keep, ram / 2))

    def band(self, resource: str) -> tuple[float, str]:
        """The plan's error band for ``resource`` ("gpu": a device, "host": a node), as a fraction
        of a peak, and what it rests on: measured where a calibration covers this run
        (:mod:`fitrl.memory.calibration`), else a wider one, assumed, naming what is not calibrated.
        A node's host band is its processes' (:meth:`host_band`): the widest of them here."""
        hw, cfg = self.hardware, self.cfg
        if resource == "host":
            if hw.device == "cpu":
                bands, measured = _cpu_host_bands(cfg.memory.host_allocator)
                kinds = {p.kind for p in self.processes if p.host_peak() > 0}
                assumed = sorted(k for k in kinds if k not in bands)
                band = max((bands[k] for k in kinds if k in bands), default=C.CPU_HOST_BAND)
                if not assumed:
                    return band, measured
                return (C.CPU_HOST_BAND_ASSUMED, f"per process: ±{band:.0%} {measured}; "
                        f"±{C.CPU_HOST_BAND_ASSUMED:.0%} assumed for "
                        f"{', '.join(_KIND_NAMES.get(k, k) for k in assumed)}")
            return C.GPU_HOST_BAND, "assumed: no calibration of a GPU node's host memory"
        # the calibration measured an engine computing with the trained module; one with weights
        # of its own adds memory it did not see
        engine = cfg.rollout.capabilities
        outside = [what for what, yes in (
            ("several devices", hw.nodes * hw.gpus_per_node > 1),
            (f"the {engine.called(cfg.rollout.engine)} engine", engine.holds_own_weights),
            ("images", self.shape.vision is not None), ("rollout workers", bool(getattr(cfg.rollout, "workers", 0))))
            if yes]
        if outside:
            return C.GPU_PLAN_BAND_ASSUMED, f"assumed: {', '.join(outside)} not calibrated"
        return C.GPU_PLAN_BAND, "measured: one H100, HF engine"

    def host_band(self, kind: str) -> float:
        """The band of one process kind's host peak: on a CPU node measured per kind and allocator
        (:data:`~fitrl.memory.calibration.CPU_HOST_BANDS`, else assumed), otherwise the node's."""
        if self.hardware.device == "cpu":
            return _cpu_host_bands(self.cfg.memory.host_allocator)[0].get(kind, C.CPU_HOST_BAND_ASSUMED)
        return self.band("host")[0]

    def node_host_at(self, phase: str, edge: int) -> int:
        """Node 0's host bytes in ``phase`` with each process's peak at the top (``edge`` +1) or
        bottom (-1) of its own band (:meth:`host_band`)."""
        total = 0.0
        for p in self.processes:
            if phase in p.phases:
                total += _on_node_0(p) * sum(p.phases[phase].host.values()) * (1 + edge * self.host_band(p.kind))
        return int(total)

    def over(self, gpu_limit: int, host_limit: int, edge: int = 0) -> list[Problem]:
        """This plan's peaks over the given limits (per device, per node), host growth included;
        ``edge`` +1 / -1 takes each peak at the top / bottom of its band (:meth:`band`; a node's
        host, each process at its own: :meth:`node_host_at`)."""
        out = []
        cuda = self.hardware.device == "cuda"
        steps = self.cfg.plan.steps or self.cfg.trainer.max_steps
        band_gpu = self.band("gpu")[0]
        scale_gpu = 1 + edge * band_gpu
        peaks = self.peaks()
        for ph, (gpu, host) in peaks.items():
            if cuda and gpu * scale_gpu > gpu_limit:
                out.append(Problem("gpu", ph, gpu, gpu_limit, at=self.at, band=band_gpu))
            if self.node_host_at(ph, edge) > host_limit:
                out.append(Problem("host", ph, host, host_limit, at=self.at, band=self._node_band(ph, host)))
        if self.growth_per_step and not any(p.resource == "host" for p in out):
            # the anchor's growth: host in a phase at step k = its steady peak + (k - 1) * growth
            ph, host = max(((ph, h) for ph, (_, h) in peaks.items()), key=lambda x: x[1])
            band_host = self._node_band(ph, host)
            k = int(host_limit / (1 + edge * band_host) - host) // self.growth_per_step + 2
            if k <= steps:  # reported where it grows: each rollout
                out.append(Problem("host", "rollout", host + (k - 1) * self.growth_per_step, host_limit, step=k,
                                   at=self.at, band=band_host))
        return out

    def _node_band(self, phase: str, host: int) -> float:
        """The node's band in ``phase``: its processes' bands weighted by their peaks."""
        return (self.node_host_at(phase, +1) - host) / host if host else self.band("host")[0]

    def judged(self) -> tuple[str, list[Problem]]:
        """The verdict and what decides it (the class docstring)."""
        base = self.expected or self  # (the same config and hardware: the same bands and limits)
        sure = [replace(p, call="does not fit") for p in base.over(base.gpu_limit, base.host_limit, -1)]
        maybe = base.over(base.gpu_limit, base.host_limit, +1)
        if self.expected is not None:
            maybe += self.over(self.gpu_limit, self.host_limit, +1)
        decided = {(p.resource, p.phase) for p in sure}  # (a growing host: its sure step, not its first possible)
        maybe = [replace(p, call="tight") for p in maybe if (p.resource, p.phase) not in decided]
        return ("does not fit" if sure else "tight" if maybe else "fits"), sure + maybe

    def problems(self) -> list[Problem]:
        """What keeps the verdict from ``fits`` (the class docstring); empty when it fits."""
        return self.judged()[1]

    @property
    def verdict(self) -> str:
        """``fits``, ``tight`` or ``does not fit`` (the class docstring)."""
        return self.judged()[0]

    @property
    def fits(self) -> bool:
        """``fits`` or ``tight``: a run that ``fitrl train`` starts."""
        return self.verdict != "does not fit"
