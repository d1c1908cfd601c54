"""The planner's types: the hardware a plan is for, a run's derived numbers, memory by component
per process and phase, and the plan with its verdict.

Processes: ``trainer`` (one per device: the policy's shard and the rollout engine in the same
process: the HF engine, or vLLM's on CPU; in one process, the in-process backend, the reference
and the critic too), ``ref`` and ``critic`` (under Ray the reference's and the critic's ranks are
Ray actors of their own, one per device on the policy's bundle: :func:`process_roles`),
``engine`` (a vLLM engine on CUDA, ``rollout.engine=vllm``: host entries per engine, device
entries per device), ``driver`` (node 0), ``node`` (what belongs to no rank: Ray, the object
store, reward workers) and ``rank0`` (rank 0's extra load and save copies). Phases follow one RL step plus load,
validation and checkpoint save; the plan is the steady state (from step 2: AdamW states exist;
gradients only inside the update, which frees them after its last optimizer step), and a phase's
peak is the sum of what is resident in it and its largest transient. A node's host peak sums its
processes; a device's peak sums what shares it (trainer, reference and critic ranks, engine). See
docs/architecture.md, "Memory model".

The phase modules (:mod:`.trainer`, :mod:`.services`) build :class:`ProcessPlan` objects from a
:class:`Run`; :func:`fitrl.memory.plan.plan_config` composes them into a :class:`Plan`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from fitrl.config import ConfigError, FitrlConfig
from fitrl.config.plan import parse_bytes
from fitrl.data.balance import micro_batches_by_tokens
from fitrl.memory import calibration as C
from fitrl.memory.lengths import Lengths
from fitrl.memory.shapes import ModelShape, VisualInput
from fitrl.memory.states import States, frozen_states, lora_states, trained_states

if TYPE_CHECKING:  # fitrl.algo imports torch; the planner only holds its spec
    from fitrl.algo import AlgorithmSpec

PHASES = ("load", "rollout", "weight_sync", "old_logprob", "ref_logprob", "update", "validation", "checkpoint_save")
ACTOR_PHASES = {"rollout", "weight_sync", "old_logprob", "update", "validation", "checkpoint_save"}


DEVICE_KINDS = ("trainer", "ref", "critic", "engine")
"""Process kinds with one process per device: their device entries are that device's."""


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

    def host_peak(self, phase: Optional[str] = None) -> int:
        return max(sum(self.phases[p].host.values()) for p in ([phase] if phase else self.phases))

    def gpu_peak(self, phase: Optional[str] = None) -> int:
        return max(sum(self.phases[p].gpu.values()) for p in ([phase] if phase else self.phases))


@dataclass
class Problem:
    resource: str      # "gpu" | "host"
    phase: str
    need: int
    limit: int
    step: int = 0      # > 0: reached only at this step (host growth)
    at: str = "caps"   # the lengths of the plan it is in: "caps" | "expected"


def active_phases(cfg: FitrlConfig, spec: AlgorithmSpec) -> list[str]:
    """The phases a run has (no reference phase without KL, no weight sync for HF generate ...)."""
    ck = getattr(cfg, "checkpoint", None)
    skip = {"ref_logprob": not spec.reference,
            "old_logprob": cfg.old_logprob_source != "pass",
            "weight_sync": cfg.rollout.engine != "vllm",
            "validation": not cfg.data.val_files,
            "checkpoint_save": ck is None or not (ck.save_freq or ck.save_final)}
    return [ph for ph in PHASES if not skip.get(ph, False)]


@dataclass
class Plan:
    """A run's memory per process and phase, at the caps, with the plan at expected lengths in
    :attr:`expected` (None when they are the caps) and the verdict (docs/architecture.md,
    "Memory model"):

    - ``fits``: at the caps every device and node stays within its margin
      (:data:`~fitrl.memory.calibration.GPU_MARGIN`, :data:`~fitrl.memory.calibration.HOST_MARGIN`);
    - ``fits at expected lengths``: not so at the caps, but at the expected lengths every peak
      stays within the margin, and at the caps within the whole device and node. Typical steps
      keep the margin the allocator needs; a step of only capped sequences, rare, still has the
      memory to run (the margin, not the memory, is what it gives up);
    - ``does not fit``: otherwise. :meth:`problems` then lists what breaks the rule: the
      expected plan's peaks over the margin (``at="expected"``) and the caps plan's over the
      whole memory (``at="caps"``); with no expected plan, the peaks over the margin at the caps.

    :attr:`fits` is true for both fitting verdicts: ``fitrl plan``'s exit status and ``fitrl
    train``'s pre-flight refusal follow it."""
    cfg: FitrlConfig
    hardware: Hardware
    shape: ModelShape
    spec: AlgorithmSpec                # the roles the algorithm builds (critic, reference)
    processes: list[ProcessPlan]
    notes: list[str]
    growth_per_step: int = 0           # host bytes per node added every step (anchor behaviours)
    lengths: Optional[Lengths] = None  # the expected lengths and where they came from (None: the caps)
    expected: Optional["Plan"] = None  # the plan at ``lengths``; None when they are the caps
    at: str = "caps"                   # this plan's lengths: "caps" | "expected"

    def process(self, kind: str) -> ProcessPlan:
        return next(p for p in self.processes if p.kind == kind)

    def device(self, phase: str) -> dict[str, int]:
        """One device's memory in ``phase``: everything that shares it, by component: one process
        of each :data:`DEVICE_KINDS` kind (the trainer rank, under Ray the reference and critic
        ranks on its bundle, the engine). The engine's entries are per device already: a vLLM
        engine with tensor parallelism takes ``gpu_memory_utilization`` of every device in its
        group, not 1/tp of it."""
        out: dict[str, int] = {}
        for p in self.processes:
            if p.kind in DEVICE_KINDS and phase in p.phases:
                for k, v in p.phases[phase].gpu.items():
                    out[k] = out.get(k, 0) + v
        return out

    def node_host(self, phase: str) -> dict[str, int]:
        """Node 0's host memory in ``phase`` (rank 0, the driver and Ray's head live there)."""
        out: dict[str, int] = {}
        for p in self.processes:
            if phase in p.phases:
                for k, v in p.phases[phase].host.items():
                    out[k] = out.get(k, 0) + v * (1 if p.kind in ("driver", "node", "rank0") else p.per_node)
        return out

    @property
    def phases(self) -> list[str]:
        return active_phases(self.cfg, self.spec)

    def peaks(self) -> dict[str, tuple[int, int]]:
        return {ph: (sum(self.device(ph).values()), sum(self.node_host(ph).values())) for ph in self.phases}

    @property
    def gpu_limit(self) -> int:
        return int(self.hardware.gpu_memory * C.GPU_MARGIN)

    @property
    def host_limit(self) -> int:
        return int(self.hardware.host_memory * C.HOST_MARGIN)

    def over(self, gpu_limit: int, host_limit: int) -> list[Problem]:
        """This plan's peaks over the given limits (per device, per node), host growth included."""
        out = []
        cuda = self.hardware.device == "cuda"
        steps = self.cfg.plan.steps or self.cfg.trainer.max_steps
        for ph, (gpu, host) in self.peaks().items():
            if cuda and gpu > gpu_limit:
                out.append(Problem("gpu", ph, gpu, gpu_limit, at=self.at))
            if host > host_limit:
                out.append(Problem("host", ph, host, host_limit, at=self.at))
        if self.growth_per_step and not any(p.resource == "host" for p in out):
            # the anchor's growth: host in a phase at step k = its steady peak + (k - 1) * growth
            ph, host = max(((ph, h) for ph, (_, h) in self.peaks().items()), key=lambda x: x[1])
            k = (host_limit - host) // self.growth_per_step + 2
            if k <= steps:  # reported where it grows: each rollout
                out.append(Problem("host", "rollout", host + (k - 1) * self.growth_per_step, host_limit, step=k,
                                   at=self.at))
        return out

    def problems(self) -> list[Problem]:
        """What breaks the verdict rule (the class docstring); empty when the run fits."""
        at_caps = self.over(self.gpu_limit, self.host_limit)
        if not at_caps or self.expected is None:
            return at_caps
        return (self.expected.over(self.expected.gpu_limit, self.expected.host_limit)
                + self.over(self.hardware.gpu_memory, self.hardware.host_memory))

    @property
    def verdict(self) -> str:
        """``fits``, ``fits at expected lengths`` or ``does not fit`` (the class docstring)."""
        if self.problems():
            return "does not fit"
        if self.expected is not None and self.over(self.gpu_limit, self.host_limit):
            return "fits at expected lengths"
        return "fits"

    @property
    def fits(self) -> bool:
        return not self.problems()


# ---------------------------------------------------------------------------------- inputs

@dataclass
class Run:
    """Numbers derived once from the config and hardware. ``lengths``: plan every sequence at
    these lengths (the expected ones) instead of the caps; what is allocated at the caps whatever
    the sequences hold (HF generate's KV cache) reads :attr:`cap_response_len`."""
    cfg: FitrlConfig
    hw: Hardware
    shape: ModelShape
    ref_shape: Optional[ModelShape]
    spec: AlgorithmSpec
    lengths: Optional[Lengths] = None

    @property
    def cuda(self) -> bool:
        return self.hw.device == "cuda"

    @property
    def phases(self) -> list[str]:
        return active_phases(self.cfg, self.spec)

    @property
    def lora(self):
        """``actor.lora`` when LoRA is on (adapters train, the base is frozen), else None."""
        lora = self.cfg.actor.lora
        return lora if lora.enabled else None

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return tuple(self.lora.target_modules) if self.lora else ()

    @property
    def fsdp(self) -> bool:
        return self.cfg.trainer.backend == "ray"

    @property
    def world(self) -> int:
        return self.hw.nodes * self.hw.gpus_per_node if self.fsdp else 1

    def shard_world(self, strategy: str) -> int:
        return self.hw.gpus_per_node if strategy == "hybrid" and self.hw.nodes > 1 else self.world

    @property
    def compute_dtype(self) -> str:
        a = self.cfg.actor
        return "bfloat16" if a.fsdp.mixed_precision else a.model.dtype  # by FSDP2, or by autocast

    @property
    def autocast(self) -> bool:
        """Mixed precision in one process: each forward holds autocast's bf16 copy of the weights."""
        return not self.fsdp and self.cfg.actor.fsdp.mixed_precision

    @property
    def prompt_len(self) -> int:
        """Tokens a prompt is planned at: the cap, or the expected length."""
        return self.lengths.prompt if self.lengths else self.cfg.data.max_prompt_length

    @property
    def response_len(self) -> int:
        """Tokens a response is planned at: the cap, or the expected length."""
        return self.lengths.response if self.lengths else self.cfg.rollout.max_response_length

    @property
    def cap_response_len(self) -> int:
        """``rollout.max_response_length``, for what is sized by it before any token is generated."""
        return self.cfg.rollout.max_response_length

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def seqs_per_rank(self) -> int:
        return max(1, self.cfg.data.rollout_batch_size * self.cfg.rollout.n // self.world)

    @property
    def mini_seqs_per_rank(self) -> int:
        """Sequences of one optimizer step on a rank (``Actor.update``'s ``sequences_per_mini_batch``)."""
        return max(1, min(self.seqs_per_rank, self.cfg.actor.mini_batch_size * self.cfg.rollout.n // self.world))

    def micro(self, size: int, update: bool = False) -> int:
        """Sequences in one forward: the count; or, with a token budget, what the actor's split
        (``Actor.partition``, fitrl/data/balance.py) puts in its largest micro-batch. The actor keeps
        every micro-batch's padded size (sequences x its longest) within the budget, as few
        micro-batches as that allows, balanced. At the caps the plan takes the worst any lengths up
        to them can make: the budget's worth, ``ceil(budget / seq_len)`` sequences of
        :attr:`seq_len` (short sequences come more to a micro-batch, never more padded tokens). At
        expected lengths it takes the split of equal sequences of that length (the typical step).
        Either way at most the sequences split together: a mini-batch in the update, the rank's
        whole batch for log-probs."""
        budget = self.cfg.actor.micro_batch_token_budget
        if not budget:
            return min(size, self.seqs_per_rank)
        seqs = self.mini_seqs_per_rank if update else self.seqs_per_rank
        if self.lengths is None:
            return max(1, min(seqs, -(-budget // max(1, self.seq_len))))
        return max(len(b) for b in micro_batches_by_tokens([self.seq_len] * seqs, budget))

    def batch_bytes(self, seqs: int) -> int:
        """A rollout batch's token tensors for ``seqs`` sequences (closed form); its images are
        counted per prompt (:meth:`pixel_values_bytes`), not per sequence."""
        return seqs * (self.seq_len * C.BATCH_BYTES_PER_TOKEN + self.response_len * C.BATCH_BYTES_PER_RESPONSE_TOKEN)

    # ------------------------------------------------------------------ images (docs/architecture.md, "Memory model")
    @property
    def images_per_prompt(self) -> int:
        """Images one prompt may carry, the worst case ``data.limit_images``, for a
        vision-language model (its config.json has a vision tower); 0 for a text model."""
        return self.cfg.data.limit_images if self.shape.vision is not None else 0

    @functools.cached_property
    def visual(self) -> Optional[VisualInput]:
        """The largest image the processor makes within ``data.max_pixels`` (the worst case of
        every image slot; None without images). Videos are not planned: nothing says whether the
        data has any, and a slot planned as ``data.max_frames`` frames would overstate every
        image-only run whose ``data.max_pixels`` is small."""
        v, d = self.shape.vision, self.cfg.data
        if v is None or not self.images_per_prompt:
            return None
        return v.largest_image(d.max_pixels, d.min_pixels)

    def pixel_values_bytes(self, prompts: int) -> int:
        """The fp32 ``pixel_values`` of ``prompts`` prompts, each with ``images_per_prompt`` of the
        largest input: per image (patches, 3 * 2 * p * p) fp32, ``patches * 3 * 2 * p * p * 4``
        bytes (a still image is repeated over the temporal patch of 2)."""
        return prompts * self.images_per_prompt * self.visual.pixel_values_bytes if self.visual else 0

    def image_processing_bytes(self) -> int:
        """What making one prompt's pixel values holds besides them
        (``PromptDataset.multi_modal_inputs``, one prompt at a time): its images decoded (PIL's
        RGBX and the processor's uint8 copy, 7 B per source pixel; sources counted at the
        ``data.max_pixels`` budget) and the processor's working copies
        (:data:`~fitrl.memory.calibration.IMAGE_PROCESSING_BYTES_PER_PIXEL` per resized pixel)."""
        visual = self.visual
        if visual is None:
            return 0
        resized = visual.height * visual.width
        return self.images_per_prompt * (self.cfg.data.max_pixels * C.IMAGE_DECODED_BYTES_PER_PIXEL
                                         + resized * C.IMAGE_PROCESSING_BYTES_PER_PIXEL)

    def prompts_received(self, phase: str) -> int:
        """Prompts whose images one trainer rank receives in ``phase``'s call under Ray (0 in-process,
        where nothing is pickled). Each rank unpickles its shard of the batch into tensors of its own;
        pickling keeps one copy of a prompt's images however many of its samples the shard holds
        (they point at one dict). ``generate`` gets 1/world of the step's prompts; the log-prob and
        update calls get ``seqs_per_rank`` sequences ordered by length
        (fitrl/data/balance.py, ``equal_count_shards``), which scatters a prompt's n samples over the
        ranks: up to one prompt per sequence, at most every prompt of the step."""
        if not self.fsdp:
            return 0
        d = self.cfg.data
        if phase == "rollout":
            return -(-d.rollout_batch_size // self.world)
        if phase == "validation":
            return -(-d.val_batch_size // self.world)
        if phase in ("old_logprob", "ref_logprob", "update"):
            return min(self.seqs_per_rank, d.rollout_batch_size)
        return 0


def role_states(run: Run) -> dict[str, tuple[States, object]]:
    """Per-rank states of each role the algorithm builds, with its fsdp config."""
    cfg, pin = run.cfg, run.cuda
    roles: dict[str, tuple[States, object]] = {}
    a = cfg.actor.fsdp
    n = run.shard_world(a.strategy)
    pinned = pin and a.cpu_offload and run.fsdp
    if run.lora:  # the frozen base and the adapters; the adapters alone have gradients and AdamW states
        roles["actor"] = (lora_states(run.shape, run.lora.rank, run.lora_targets, n, cfg.actor.model.dtype, pinned), a)
    else:
        roles["actor"] = (trained_states(run.shape, n, cfg.actor.model.dtype, pinned=pinned,
                                         frozen_vision=cfg.actor.model.freeze_vision_tower), a)
    if run.spec.reference and not run.lora:  # with LoRA the reference is the policy with its adapters off
        r = cfg.ref.fsdp
        dtype = (cfg.ref.model or cfg.actor.model).dtype
        roles["ref"] = (frozen_states(run.ref_shape or run.shape, run.shard_world(r.strategy), dtype,
                                      pinned=pin and r.cpu_offload and run.fsdp), r)
    if run.spec.critic:
        c = cfg.critic.fsdp
        roles["critic"] = (trained_states(run.shape, run.shard_world(c.strategy), "float32",
                                          pinned=pin and c.cpu_offload and run.fsdp), c)
    return roles


def process_roles(run: Run) -> dict[str, tuple[str, ...]]:
    """The roles (keys of :func:`role_states`) each per-device process kind holds. In one process
    (``trainer.backend=inprocess``) the trainer holds every role. Under Ray each role is a
    ``RayWorkerGroup`` of its own (fitrl/trainer/run.py, ``make_group``): the reference's and the
    critic's ranks are Ray actors colocated rank by rank on the policy's bundles (same node, same
    device), each a process with its own runtime (and CUDA context); with LoRA the reference is
    the policy with its adapters off, no process of its own (:func:`role_states` has no "ref")."""
    roles = tuple(role_states(run))
    if not run.fsdp:
        return {"trainer": roles}
    return {"trainer": ("actor",), **{r: (r,) for r in ("ref", "critic") if r in roles}}


def resident(role: str, fsdp, phase: str, run: Run) -> tuple[bool, bool]:
    """(weights and gradients on the device, optimizer states on the device) in ``phase``."""
    if not run.cuda or (fsdp.cpu_offload and run.fsdp):
        return False, False
    actor = ACTOR_PHASES | ({"ref_logprob"} if run.lora else set())  # LoRA: the policy computes the reference
    active = {"actor": actor, "ref": {"ref_logprob"}, "critic": {"old_logprob", "update"}}[role]
    on = phase in active or not fsdp.offload_params
    return on, phase == "update" or not fsdp.offload_optimizer
