"""The typed configuration of a fitrl run.

One YAML file plus dotted overrides (``actor.optim.lr=1e-5``) fill these dataclasses; the
loader (:mod:`fitrl.config.loader`) rejects unknown keys with the nearest valid key and
wrong types with the expected type. Every field carries a docstring: ``fitrl config --doc``
prints them. Cross-field checks live in ``__post_init__`` and say what to change; nothing
here copies one field into another behind the user's back.

Batch sizes have one definition (DESIGN §3):
  data.rollout_batch_size  prompts drawn per RL step
  rollout.n                responses sampled per prompt (a step makes rollout_batch_size * n sequences)
  actor.mini_batch_size    prompts per optimizer step
  actor.micro_batch_size   sequences per forward/backward; gradient accumulation fills the mini-batch
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration problem a user can fix; the CLI prints it as one line and exits 2."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training prompts: jsonl, json or parquet files, or a directory saved by ``datasets.save_to_disk``."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompts for validation (same formats); empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (or a list of chat messages)."""
    answer_key: str = "answer"
    """Column holding the reference answer passed to the reward function."""
    prompt_template: Optional[str] = None
    """Optional jinja template rendered with the row's columns to form the user message, e.g. ``'Compute {{ prompt }}'``."""
    system_prompt: Optional[str] = None
    """Optional system message put before the user message."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (with the generation prompt)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped; the count dropped is reported at start-up."""
    rollout_batch_size: int = 8
    """Prompts drawn per RL step."""
    val_batch_size: int = 64
    """Prompts per generation call during validation (memory knob only; all val prompts are used)."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by ``trainer.seed``)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear warm-up length in RL steps (the scheduler advances once per RL step)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Shape after warm-up: constant, or cosine decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each optimizer step (0 disables)."""

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"actor.optim.betas must have two values, got {self.betas}")
        if self.lr <= 0:
            raise ConfigError(f"actor.optim.lr must be positive, got {self.lr}")


@dataclass
class ModelConfig:
    path: str = ""
    """Local Hugging Face model directory (config.json, weights, tokenizer). Nothing is downloaded."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are held in (the actor's are its master weights, so keep float32 there)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory when it differs from ``path``."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (trades ~30% more compute for far less activation memory)."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``)."""


@dataclass
class FSDPConfig:
    strategy: Literal["full", "hybrid"] = "full"
    """``full``: shard over all ranks; ``hybrid``: shard within a node, replicate across nodes."""
    init: Literal["rank0", "every_rank"] = "rank0"
    """``rank0``: rank 0 reads the checkpoint and broadcasts into the shards (host memory ~ one copy per node); ``every_rank``: each rank reads it."""
    mixed_precision: bool = False
    """bf16 parameters for compute and all-gather, fp32 master weights and gradient reduction (FSDP2 MixedPrecisionPolicy)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: shards, gradients and optimizer step live in host memory, copied to the device per layer."""
    offload_params: bool = False
    """Move this role's parameter shards to host memory between its phases (e.g. during rollout) and back."""
    offload_optimizer: bool = False
    """Move optimizer states to host memory between updates."""


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (``dtype`` must be float32: the actor's weights are its master weights)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    mini_batch_size: int = 8
    """Prompts per optimizer step; ``data.rollout_batch_size / mini_batch_size`` optimizer steps per epoch."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one device; gradient accumulation fills the mini-batch."""
    logprob_micro_batch_size: int = 16
    """Sequences per forward when computing log-probs without gradients."""
    micro_batch_token_budget: int = 0
    """When > 0, micro-batches (update and log-prob) are formed by tokens instead: as few as keep each near this many prompt+response tokens, balanced, and the same number on every rank. 0 uses the sequence counts above."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per RL step."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at ``1 - clip_ratio_low``."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is clipped above at ``1 + clip_ratio_high`` (raise it for DAPO clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual clip: for negative advantages the per-token loss is capped at ``-A * clip_ratio_c`` (values <= 1 disable it)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the loss (0 disables; entropy is still logged)."""
    logprob_chunk_size: int = 1024
    """Response tokens per chunk when turning logits into log-probs: bounds the fp32 ``tokens x vocab`` temporary."""
    shuffle_mini_batches: bool = False
    """Shuffle sequences before splitting into mini-batches."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the actor (used by the Ray backend)."""

    def __post_init__(self) -> None:
        if self.model.dtype != "float32":
            # AdamW stepping bf16 weights rounds most updates away (measured: 2% of a tiny
            # model's parameters changed after one step at lr 1e-6); mixed precision keeps fp32
            # master weights and computes in bf16, which arrives with FSDP2.
            raise ConfigError(f"actor.model.dtype={self.model.dtype} would make AdamW update low-precision "
                              "weights directly; keep actor.model.dtype=float32 (ref.model.dtype may be bfloat16)")
        for name in ("ppo_epochs", "logprob_micro_batch_size", "logprob_chunk_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"actor.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class CriticConfig:
    model: Optional[ModelConfig] = None
    """Value model (a token-classification head on this checkpoint); unset: the actor's model path. Built only for ``gae``."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer and schedule."""
    mini_batch_size: int = 8
    """Prompts per critic optimizer step."""
    micro_batch_size: int = 8
    """Sequences per critic forward/backward."""
    values_micro_batch_size: int = 16
    """Sequences per forward when computing values without gradients."""
    ppo_epochs: int = 1
    """Critic passes over the batch per RL step."""
    cliprange_value: float = 0.5
    """Clip range of the value update around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss."""
    warmup_steps: int = 0
    """RL steps at the start during which only the critic learns (the actor is not updated)."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the critic (used by the Ray backend)."""


@dataclass
class RefConfig:
    model: Optional[ModelConfig] = None
    """Reference model; when unset, a frozen copy of the actor's initial model (same path and dtype)."""
    logprob_micro_batch_size: int = 16
    """Sequences per forward when computing reference log-probs."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding and offload of the reference model (used by the Ray backend)."""


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 disables)."""
    n: int = 1
    """Responses sampled per prompt."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"rollout.val.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.val.top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ConfigError(f"rollout.val.n must be >= 1, got {self.n}")
        if self.top_k < 0:
            raise ConfigError(f"rollout.val.top_k must be >= 0 (0 disables), got {self.top_k}")


@dataclass
class RolloutConfig:
    engine: Literal["hf"] = "hf"
    """Generation engine: ``hf`` (transformers ``generate``; CPU and GPU)."""
    n: int = 8
    """Responses sampled per prompt during training (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature during training; log-probs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass during training (1.0 disables)."""
    top_k: int = 0
    """Top-k sampling during training (0 disables)."""
    max_response_length: int = 256
    """New tokens generated at most per response."""
    micro_batch_size: int = 64
    """Sequences per ``generate`` call (memory knob; results do not depend on it)."""
    ignore_eos: bool = False
    """Never stop at EOS: every response is ``max_response_length`` tokens (benchmarks, memory tests)."""
    val: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, n=1))
    """Sampling for validation (greedy, one response per prompt, by default)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(
                "rollout.temperature must be > 0 for training (policy-gradient log-probs need a"
                " sampling distribution); use rollout.val.temperature=0 for greedy validation"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_response_length < 1 or self.micro_batch_size < 1:
            raise ConfigError("rollout.max_response_length and rollout.micro_batch_size must be >= 1")


@dataclass
class KLRewardConfig:
    enable: bool = False
    """Subtract ``coef * KL(policy || reference)`` from every response token's reward (PPO-style); builds a reference model."""
    estimator: str = "k1"
    """Per-token KL estimator used in the reward (``k1``, ``k2``, ``k3``, ``abs``, ``mse``)."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps ``coef``; ``adaptive`` steers it towards ``target_kl`` (Ziegler et al. 2019)."""
    coef: float = 0.001
    """KL coefficient (the initial one for the adaptive controller)."""
    target_kl: float = 0.1
    """Adaptive controller: target mean KL per sequence."""
    horizon: int = 10000
    """Adaptive controller: sequences over which the coefficient adapts."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose samples all scored the same (no advantage signal) and draw more prompts."""
    metric: str = "score"
    """What must vary within a group: ``score`` (the total reward) or a reward component name (e.g. ``exact``)."""
    max_num_gen_batches: int = 10
    """Generation rounds per step at most (including the first); 0 means no bound."""
    on_exhausted: Literal["continue", "stop"] = "continue"
    """When the bound is hit with a partial batch: ``continue`` with what was kept, or ``stop`` the run with a message."""


@dataclass
class OverlongConfig:
    enable: bool = False
    """DAPO soft overlong punishment: responses in the last ``buffer_length`` tokens before ``rollout.max_response_length`` lose reward linearly."""
    buffer_length: int = 4
    """Length of the penalty ramp in tokens."""
    penalty_factor: float = 1.0
    """Penalty at exactly ``rollout.max_response_length`` tokens."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, from the registry in ``fitrl.algo.advantages`` (e.g. ``grpo``)."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred scores by the group's standard deviation (``drgrpo`` never does)."""
    gamma: float = 1.0
    """Discount for GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda."""
    policy_loss: str = "ppo_clip"
    """Policy loss, from the registry in ``fitrl.algo.losses``."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (Dr.GRPO); denominators are global over the mini-batch."""
    use_kl_loss: bool = False
    """Add ``kl_coef * KL(policy || reference)`` to the loss; builds a reference model."""
    kl_coef: float = 0.001
    """Weight of the KL term when ``use_kl_loss`` is on."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: ``k1``, ``k2``, ``k3`` (low-variance, a.k.a. low_var_kl)."""
    recompute_old_logprob: bool = True
    """Recompute the behaviour log-probs with the actor before the update; off reuses the rollout's."""
    kl_in_reward: KLRewardConfig = field(default_factory=KLRewardConfig)
    """KL penalty in the reward (the alternative to ``use_kl_loss``)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling (online filtering of uninformative groups)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong reward shaping."""


@dataclass
class RewardConfig:
    function: str = "arith"
    """Reward: a registered name (``arith``) or ``path/to/file.py:function`` / ``package.module:function``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the reward function (weights, options)."""
    num_workers: int = 2
    """Reward worker processes (each ~60-70 MB of host memory). 0 scores in the driver process, where nothing bounds a call's time."""
    timeout: float = 10.0
    """Wall-clock seconds one reward call may take (one response; the whole batch when ``batched``); past it the worker is killed and replaced and the call scores ``fallback_score``."""
    fallback_score: float = 0.0
    """Score of a call that timed out or raised; counted in ``reward/timeouts`` / ``reward/errors`` and its input logged once."""
    max_error_fraction: float = 0.5
    """Stop the run when more than this fraction of one batch's responses raise (a broken function, not a hard sample); 1.0 never stops. Timeouts do not count."""
    batched: bool = False
    """The function takes lists: ``fn(responses, answers, **kwargs)`` returns one result per response (one call per batch)."""


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
    """Address of a running Ray cluster (``auto`` or ``HOST:6379``); unset starts a local one."""
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

    def __post_init__(self) -> None:
        for name, low in (("max_steps", 0), ("val_freq", 0), ("log_freq", 1), ("num_threads", 0), ("nnodes", 1),
                          ("devices_per_node", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"trainer.{name} must be >= {low}, got {getattr(self, name)}")


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
    """Every step, per process and phase: host RSS, USS and peak RSS, node available memory, GPU allocated/reserved/peak, into metrics.jsonl (``mem/<process>/<phase>/...``) and the console line."""
    uss_min_phase_s: float = 0.1
    """USS (memory only this process holds) is read after phases lasting at least this long: a reading walks the page tables, ~3 ms with torch loaded."""
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
        if not 0 < self.guard_min_available_fraction < 1 or not 0 < self.guard_gpu_max_fraction <= 1:
            raise ConfigError("memory.guard_min_available_fraction must be in (0, 1) and "
                              "memory.guard_gpu_max_fraction in (0, 1]")


@dataclass
class FitrlConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts: files, columns, templates, lengths, the rollout batch size."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, policy loss, KL."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy: model, optimizer, mini/micro batches."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when KL is used)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (built only for estimators that need values, e.g. ``gae``)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: engine, sampling, response length."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The rule reward."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, seed, device, run directory, validation and logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, keeping and resuming checkpoints (under ``<run dir>/checkpoints``)."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The memory plan before the run, telemetry and leak detection during it, the guard at the edge."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks of every trained role."""
        t = self.trainer
        return t.nnodes * t.devices_per_node if t.backend == "ray" else 1

    def __post_init__(self) -> None:
        check_batch_sizes(self, world_size=self.world_size)
        if self.trainer.backend == "inprocess":
            for role in ("actor", "ref", "critic"):
                f = getattr(self, role).fsdp
                if f.mixed_precision or f.cpu_offload or f.strategy == "hybrid":
                    raise ConfigError(f"{role}.fsdp options need FSDP2, which runs under trainer.backend=ray "
                                      "(use trainer.devices_per_node=1 for a single rank)")
        if self.data.rollout_batch_size % self.world_size:
            raise ConfigError(f"data.rollout_batch_size={self.data.rollout_batch_size} prompts do not split over "
                              f"{self.world_size} ranks: make it a multiple of {self.world_size}")
        if self.algorithm.use_kl_loss and self.algorithm.kl_in_reward.enable:
            raise ConfigError("algorithm.use_kl_loss and algorithm.kl_in_reward.enable are both on: the KL would "
                              "be counted twice; choose one")
        if self.algorithm.overlong.enable and self.algorithm.overlong.buffer_length >= self.rollout.max_response_length:
            raise ConfigError(f"algorithm.overlong.buffer_length={self.algorithm.overlong.buffer_length} must be "
                              f"smaller than rollout.max_response_length={self.rollout.max_response_length}")
        c, t = self.checkpoint, self.trainer
        if c.keep_best is not None:
            if not self.data.val_files:
                raise ConfigError(f"checkpoint.keep_best={c.keep_best} needs validation: set data.val_files")
            if c.save_freq and (not t.val_freq or c.save_freq % t.val_freq):
                raise ConfigError(f"checkpoint.keep_best ranks checkpoints by a validation metric, but "
                                  f"trainer.val_freq={t.val_freq} does not divide checkpoint.save_freq={c.save_freq}: "
                                  f"set trainer.val_freq={c.save_freq}")

    @property
    def uses_reference(self) -> bool:
        """A reference model is built only when some KL term needs it."""
        return self.algorithm.use_kl_loss or self.algorithm.kl_in_reward.enable


def check_batch_sizes(cfg: FitrlConfig, world_size: int) -> None:
    """Divisibility of the batch sizes (DESIGN §3), with what to change when it fails."""
    rbs, n = cfg.data.rollout_batch_size, cfg.rollout.n
    mini, micro = cfg.actor.mini_batch_size, cfg.actor.micro_batch_size
    for name, value in [("data.rollout_batch_size", rbs), ("rollout.n", n),
                        ("actor.mini_batch_size", mini), ("actor.micro_batch_size", micro)]:
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if rbs % mini:
        raise ConfigError(
            f"data.rollout_batch_size={rbs} is not a multiple of actor.mini_batch_size={mini}: "
            f"set actor.mini_batch_size to a divisor of {rbs} (e.g. {_largest_divisor_at_most(rbs, mini)})"
        )
    seqs_per_rank = mini * n // world_size if (mini * n) % world_size == 0 else None
    if seqs_per_rank is None:
        raise ConfigError(
            f"a mini-batch of {mini} prompts x {n} samples = {mini * n} sequences does not split over "
            f"{world_size} ranks: make actor.mini_batch_size * rollout.n a multiple of {world_size}"
        )
    if seqs_per_rank % micro:
        ranks = f" / {world_size} ranks" if world_size > 1 else ""
        raise ConfigError(
            f"a mini-batch has {seqs_per_rank} sequences per rank (actor.mini_batch_size={mini} x "
            f"rollout.n={n}{ranks}), not a multiple of actor.micro_batch_size={micro}: "
            f"set actor.micro_batch_size to a divisor of {seqs_per_rank} "
            f"(e.g. {_largest_divisor_at_most(seqs_per_rank, micro)})"
        )


def check_critic_batch_sizes(cfg: FitrlConfig, world_size: int) -> None:
    """Checked only when a critic is built (its defaults need not fit runs without one)."""
    c, rbs, n = cfg.critic, cfg.data.rollout_batch_size, cfg.rollout.n
    if rbs % c.mini_batch_size:
        raise ConfigError(f"data.rollout_batch_size={rbs} is not a multiple of critic.mini_batch_size="
                          f"{c.mini_batch_size}: set critic.mini_batch_size to a divisor of {rbs}")
    seqs = c.mini_batch_size * n
    if seqs % world_size or (seqs // world_size) % c.micro_batch_size:
        raise ConfigError(f"a critic mini-batch has {seqs} sequences (critic.mini_batch_size x rollout.n) over "
                          f"{world_size} rank(s): make it a multiple of critic.micro_batch_size={c.micro_batch_size}")


def _largest_divisor_at_most(total: int, limit: int) -> int:
    return max(d for d in range(1, min(total, limit) + 1) if total % d == 0)


def derived_batch_numbers(cfg: FitrlConfig, world_size: int = 1) -> dict[str, int]:
    """The numbers printed at start-up so nobody has to derive them by hand."""
    seqs = cfg.data.rollout_batch_size * cfg.rollout.n
    mini_seqs = cfg.actor.mini_batch_size * cfg.rollout.n
    opt_steps = cfg.data.rollout_batch_size // cfg.actor.mini_batch_size * cfg.actor.ppo_epochs
    return {
        "prompts_per_step": cfg.data.rollout_batch_size,
        "sequences_per_step": seqs,
        "sequences_per_mini_batch": mini_seqs,
        "optimizer_steps_per_rl_step": opt_steps,
        "grad_accumulation_steps": mini_seqs // world_size // cfg.actor.micro_batch_size,
        "world_size": world_size,
    }
