"""The sections of how a run runs: the trainer (steps, devices, backend, loggers, divergence),
checkpoints and memory. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from fitrl.core.driver_phases import DRIVER_PHASES, suggest
from fitrl.core.errors import ConfigError

@dataclass
class DivergenceConfig:
    enable: bool = True
    """Judge every step's metrics (fitrl/trainer/divergence.py) and stop a run that has diverged, with the reason, without saving a checkpoint of its weights; no checkpoint is written either while a signal below is pending."""
    patience: int = 3
    """Consecutive steps a soft signal (a saturated or collapsed policy, KL or reward beyond its bound) must last before the run stops. Non-finite losses, gradient norms, weights, rewards or logits stop it at once."""
    uniform_entropy_fraction: float = 0.99
    """Saturated policy: mean token entropy at or above this fraction of log(vocabulary size), with a zero gradient norm although the advantages are not all zero (the logits no longer depend on the weights)."""
    min_entropy: float = 1e-4
    """Collapsed policy: mean token entropy (nats) at or below this with a zero gradient norm (every sample of a prompt the same: nothing left to learn from)."""
    zero_grad_norm: float = 1e-8
    """A gradient norm at or below this counts as zero for the two signals above."""
    max_kl: float = 10.0
    """Mean per-token KL to the reference (``actor/kl_loss``, or ``kl_in_reward/kl`` per response token) above which the policy has run away from it; 0 disables."""
    max_abs_reward: float = 1e4
    """``|reward/mean|`` above which the reward has blown up (a reward function or shaping gone wrong); 0 disables."""

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ConfigError(f"trainer.divergence.patience must be >= 1 step, got {self.patience}")
        if not 0 < self.uniform_entropy_fraction <= 1:
            raise ConfigError("trainer.divergence.uniform_entropy_fraction must be in (0, 1], got "
                              f"{self.uniform_entropy_fraction}")
        for name in ("min_entropy", "zero_grad_norm", "max_kl", "max_abs_reward"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"trainer.divergence.{name} must be a finite number >= 0, got {value}")


@dataclass
class TrainerConfig:
    max_steps: int = 20
    """RL steps to run."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where roles run: ``auto`` picks cuda when available."""
    backend: Literal["inprocess", "ray"] = "inprocess"
    """``inprocess``: one worker in the driver process (CPU or one GPU); ``ray``: one Ray actor per rank with FSDP2."""
    nnodes: int = 1
    """Nodes of the Ray cluster to use (``ray`` backend)."""
    devices_per_node: int = 1
    """Ranks per node (GPUs per node, or worker processes per node on CPU); world size = nnodes x devices_per_node."""
    ray_address: Optional[str] = None
    """Address of a running Ray cluster (``auto`` or ``HOST:6379``); unset starts a local one. One that does not answer stops the run in one line within seconds (exit 2)."""
    placement_timeout_s: float = 300.0
    """The longest wait, per worker group, for the Ray cluster to give its CPUs and GPUs (``nnodes`` > 1: on distinct nodes) while other jobs hold them, or for nodes to join a joined cluster that cannot hold them (a restart after a lost node waits this long for one to come back); then the run stops in one line naming what was asked and each node's free CPUs and GPUs (exit 2). A request a cluster started by this run can never give is refused at once."""
    num_threads: int = 0
    """torch intra-op threads on CPU (0 keeps torch's default)."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    experiment_name: str = "fitrl"
    """Run directory name under ``output_dir`` (a timestamp is appended unless ``run_dir`` is set)."""
    run_dir: Optional[str] = None
    """Exact run directory; overrides ``output_dir``/``experiment_name``."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_freq: int = 0
    """Validate every this many steps (0: only before training and at the end)."""
    val_only: bool = False
    """Run validation alone and exit."""
    log_freq: int = 1
    """Print one console line every this many steps (metrics.jsonl always gets every step)."""
    progress_bar: bool = True
    """Show a rich progress bar over steps (only on a terminal)."""
    loggers: list[str] = field(default_factory=lambda: ["console"])
    """Where metrics go besides ``metrics.jsonl`` (always written): ``console`` (the step line), ``tensorboard`` (``<run_dir>/tensorboard``), ``wandb`` (``<run_dir>/wandb``), ``mlflow`` (``<run_dir>/mlflow.db``); e.g. ``[console, wandb]``. All but console need ``pip install 'fitrl[trackers]'``."""
    project_name: str = "fitrl"
    """W&B project / MLflow experiment the run is logged under; the tracker run is named after the run directory."""
    wandb_mode: Optional[Literal["online", "offline"]] = None
    """W&B mode; unset: ``WANDB_MODE`` if set, else ``online`` when an API key is configured (``WANDB_API_KEY`` or ``wandb login``), else ``offline`` (upload later with ``wandb sync``)."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking URI; unset: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<run_dir>/mlflow.db``."""
    log_samples: int = 8
    """Generation samples (prompt, response, answer, reward and its components) written to ``<run_dir>/generations.jsonl`` and as a table to the trackers, per validation and per sampled training step; 0: none."""
    log_samples_freq: int = 10
    """Write training samples every this many steps (0: validation samples only)."""
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    """Divergence detection: which step metrics stop a run that has diverged."""
    signal_grace_s: float = 25.0
    """After the first SIGINT/SIGTERM the run stops at the next safe point (before the step's next phase, or after its update) and saves an emergency checkpoint if that save ends within this many seconds of the signal (judged by this run's last save; Slurm and Kubernetes send SIGKILL 30 s after SIGTERM by default); otherwise the last complete checkpoint is the resume point. A second signal stops at once. Exit status 130 (SIGINT) or 143 (SIGTERM). 0: never save on a signal."""
    hang_timeout_s: float = 1800.0
    """A phase with no progress (no decode step, micro-batch or scored response, on any rank) for this many seconds is a hang: fitrl prints the phase, each rank's idle time and Python stack, records a ``hang`` event and stops (exit 1, the resume point named). Under Ray the collectives time out 70 s above the largest of this and ``hang_timeouts`` (the watchdog fires and reports first; a dead peer still surfaces), and after an hour at least where a phase has no watchdog. 0: no watchdog."""
    max_restarts: int = 0
    """After a dead worker (a Ray rank killed or crashed) or a hang, start again up to this many times: the worker groups rebuilt, the run resumed from its newest complete checkpoint in the same run directory (``metrics.jsonl`` reads as one run, with a ``restart`` event). A config, data or reward error, a divergence or a memory-guard stop is never retried."""
    hang_timeouts: dict[str, float] = field(default_factory=dict)
    """Per-phase limits over ``hang_timeout_s``, e.g. ``{checkpoint_save: 3600}`` (0 turns one phase's watchdog off). The phases: ``data``, ``rollout``, ``baseline_rollout``, ``reward``, ``old_logprob``, ``ref``, ``teacher_logprob``, ``values``, ``advantage``, ``critic_update``, ``update``, ``weight_sync``, ``validation``, ``checkpoint_save``; another key is refused."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for ``perf/mfu`` (e.g. ``989e12``); 0: the GPU's datasheet figure from a table, or on CPU a matmul benchmark measured once and cached in fitrl's cache directory (``$FITRL_CACHE_DIR``, default ``~/.cache/fitrl``)."""

    def __post_init__(self) -> None:
        for name, low in (("max_steps", 0), ("val_freq", 0), ("log_freq", 1), ("num_threads", 0), ("nnodes", 1),
                          ("devices_per_node", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"trainer.{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("log_samples", "log_samples_freq"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.signal_grace_s) and self.signal_grace_s >= 0):
            raise ConfigError(f"trainer.signal_grace_s must be a number of seconds >= 0, got {self.signal_grace_s}")
        if isinstance(self.placement_timeout_s, bool) or not isinstance(self.placement_timeout_s, (int, float)) \
                or not (math.isfinite(self.placement_timeout_s) and self.placement_timeout_s > 0):
            raise ConfigError(f"trainer.placement_timeout_s must be a number of seconds > 0, got "
                              f"{self.placement_timeout_s!r}")
        if self.max_restarts < 0:
            raise ConfigError(f"trainer.max_restarts must be >= 0, got {self.max_restarts}")
        for phase in self.hang_timeouts:
            if phase not in DRIVER_PHASES:
                near = suggest(str(phase))
                hint = f"; did you mean {near!r}?" if near else ""
                raise ConfigError(f"trainer.hang_timeouts.{phase}: no phase is called {phase!r}{hint} (the phases: "
                                  f"{', '.join(DRIVER_PHASES)})")
        for key, value in [("hang_timeout_s", self.hang_timeout_s),
                           *((f"hang_timeouts.{k}", v) for k, v in self.hang_timeouts.items())]:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"trainer.{key} must be a number of seconds >= 0 (0: off), got {value!r}")
        if not (math.isfinite(self.peak_flops) and self.peak_flops >= 0):
            raise ConfigError(f"trainer.peak_flops must be a FLOP/s figure >= 0 (0: detect), got {self.peak_flops}")


@dataclass
class CheckpointConfig:
    save_freq: int = 0
    """Save a checkpoint every this many RL steps (0: none during training; see ``save_final``)."""
    save_final: bool = True
    """Save a checkpoint when training ends (after the final validation)."""
    save_limit: int = 0
    """Keep only the newest this many checkpoints of the run (0 keeps all); the best by ``keep_best`` is kept as well."""
    keep_best: Optional[str] = None
    """A validation metric, e.g. ``val/reward/mean``: the checkpoint with the best value is kept beyond ``save_limit``. Only checkpoints saved at a validation step have a value, so ``trainer.val_freq`` must divide ``save_freq``."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether a larger (``max``) or smaller (``min``) ``keep_best`` value is better."""
    model_only: bool = False
    """Save the weights only (no optimizer, scheduler, data position or RNG states): a third of the size, for ``fitrl export``; such a checkpoint cannot be resumed."""
    resume: str = "auto"
    """``auto``: continue from the newest complete checkpoint in ``trainer.run_dir`` (only when ``trainer.run_dir`` is set: a timestamped run directory is new on every launch, so re-running a command never picks up an older run by accident); ``never``: start from step 0; or a path: a ``step_N`` checkpoint, or a run directory (its newest complete checkpoint)."""
    strict_config: bool = True
    """Refuse to resume when a setting that changes the training trajectory (lr, batch sizes, data, seed, ...) differs from the checkpoint's ``config.yaml``; false prints the differences and continues."""
    on_corrupt: Literal["error", "previous"] = "error"
    """A checkpoint to resume whose files do not match the checksums (or sizes) recorded when it was saved: ``error`` refuses, naming the file; ``previous`` says so and resumes from the newest earlier complete checkpoint that is intact."""

    def __post_init__(self) -> None:
        for name in ("save_freq", "save_limit"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_best is not None and not self.keep_best.startswith("val/"):
            raise ConfigError(f"checkpoint.keep_best={self.keep_best!r} must name a validation metric, "
                              "e.g. val/reward/mean")
        if not self.resume:
            raise ConfigError("checkpoint.resume is empty: use auto, never, or a checkpoint path")


@dataclass
class MemoryConfig:
    plan: Literal["enforce", "warn", "off"] = "enforce"
    """Before any model loads, ``fitrl train`` predicts memory per phase for the hardware it sees (as ``fitrl plan`` does): ``enforce`` refuses a config predicted not to fit, printing the plan and the cheapest change that fits; ``warn`` prints the same and goes on; ``off`` skips it."""
    telemetry: bool = True
    """Every step, per process and phase: host RSS and peak RSS, node available memory, GPU allocated/reserved/peak (kernel and CUDA counters, ~25 us a reading), and USS as ``uss_every`` says, into metrics.jsonl (``mem/<process>/<phase>/...``) and the console line."""
    phase_peaks: Literal["sample", "rewind"] = "sample"
    """Where each phase's peak RSS (``host_peak_gib``) comes from. ``sample``: the kernel's high-water mark is left alone, so ``/usr/bin/time -v`` and ``ru_maxrss`` report the process's peak; a phase that raises it reads its peak from it, exactly, any other phase the largest RSS a helper process saw every 5 ms (a lower bound, short only by a spike briefer than that). ``rewind``: the mark is rewound at each phase's start (Linux ``/proc/self/clear_refs``), exact for every phase (the calibration benches use it), and the kernel's lifetime figure then means the peak since the last phase began (``mem/host_peak_rss_gib`` keeps the lifetime one either way)."""
    uss_every: int = 10
    """USS (memory only this process holds) is read at the end of every this many steps (the 1st, the ``uss_every + 1``-th, ... of each launch: a resumed run counts from its first step), per process, as ``host_uss_gib`` of the step's last phase; and at the end of any phase after the guard found the node's available memory under 1.5x its threshold. 0: only then. A reading walks the page tables: ~14 ms per GiB of RSS (38 ms at 2.8 GiB)."""
    uss_min_phase_s: Optional[float] = None
    """Also read USS at the end of every phase lasting at least this long (0: every phase), for a per-phase breakdown; unset: not per phase. Each reading costs what ``uss_every`` says."""
    trim_heap: bool = True
    """CPU processes (``trainer.device=cpu``) give the heap's free pages back to the OS (glibc ``malloc_trim``) at the end of each role's phase (generation, log-probs, values, updates) and after each micro-batch of a log-prob, value or update phase. glibc otherwise keeps most of an update's freed memory resident into the next step, and lets the heap grow over a phase's micro-batches, amounts that vary from run to run; trimmed, a phase's host memory is what it holds plus one micro-batch's working set, which the CPU memory plan assumes (``plan.host_malloc=glibc``). Costs a few page faults per micro-batch (bench/RESULTS.md, "Host memory on CPU"). false: no trim (the plan then counts what glibc keeps)."""
    host_allocator: Literal["glibc", "jemalloc", "tcmalloc"] = "glibc"
    """The host memory allocator of every fitrl process: ``glibc`` (default: the C library's malloc), or ``jemalloc`` / ``tcmalloc``, preloaded (``LD_PRELOAD``): the ``fitrl`` command restarts itself with the library before anything loads, and every process it starts (reward and tool workers, Ray actors) inherits it. The library is looked for in ``$FITRL_ALLOCATOR_DIR``, ``.cache/allocators`` (``make allocators``) and the system's library directories; missing, the run stops with a line saying where to get it. Measured on CPU (bench/RESULTS.md, "Host allocators"): faster steps on a tiny model, higher steady RSS and lower phase peaks; the CPU plan keeps glibc's factors with a wider band, marked assumed. Started from Python (``fitrl.train``), the calling process keeps its allocator and only the processes it starts get this one."""
    expandable_segments: Literal["auto", "on", "off"] = "auto"
    """GPU runs: PyTorch's caching allocator with expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which grows and shrinks a segment in place instead of keeping freed blocks of odd sizes that later requests cannot use: the fragmentation that makes reserved memory climb while allocated memory stays flat, until an OOM steps later. ``auto``: on unless the run uses vLLM with a sleep level above 0 (its sleep mode allocates from a memory pool that refuses expandable segments) or ``PYTORCH_CUDA_ALLOC_CONF`` is set already (it is then kept as it is); ``on`` / ``off``: as said. Set for every process the run starts, before CUDA is initialised. The leak detector tells fragmentation (the cache, reserved minus allocated, growing) from a leak (allocated growing)."""
    leak_warmup_steps: int = 5
    """Steps ignored by leak detection (allocator pools, caches and compiled kernels settle first)."""
    leak_window: int = 50
    """Leak detection fits its trend over at most this many recent steps; it judges once it has min(30, this) steps after warm-up."""
    leak_min_rate_mib: float = 1.0
    """Growth (MiB per step, per process and phase) below which no leak is reported, unless memory would run out before ``trainer.max_steps`` at that rate."""
    guard: bool = True
    """Stop the run cleanly (abandon a read-only phase or finish an update, write an emergency checkpoint, explain) when the node's available memory or a GPU's free memory runs low, before the OS or Ray kills a process."""
    guard_min_available_gib: Optional[float] = None
    """Node available memory (GiB) under which the guard stops the run; unset: ``guard_min_available_fraction`` of the node's RAM."""
    guard_min_available_fraction: float = 0.07
    """Fraction of the node's RAM; the default stops before Ray's memory monitor, which kills workers at 95 % used."""
    guard_gpu_max_fraction: float = 0.97
    """Used fraction of a GPU (all processes on it) above which the guard stops the run."""

    def __post_init__(self) -> None:
        if self.leak_warmup_steps < 0 or self.leak_window < 10:
            raise ConfigError("memory.leak_warmup_steps must be >= 0 and memory.leak_window >= 10")
        if self.uss_every < 0 or (self.uss_min_phase_s is not None and self.uss_min_phase_s < 0):
            raise ConfigError(f"memory.uss_every must be >= 0 (0: USS only near the guard's threshold) and "
                              f"memory.uss_min_phase_s unset or >= 0 seconds, got {self.uss_every} and "
                              f"{self.uss_min_phase_s}")
        if not 0 < self.guard_min_available_fraction < 1 or not 0 < self.guard_gpu_max_fraction <= 1:
            raise ConfigError("memory.guard_min_available_fraction must be in (0, 1) and "
                              "memory.guard_gpu_max_fraction in (0, 1]")
