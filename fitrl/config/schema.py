"""The typed configuration of a fitrl run.

One YAML file plus dotted overrides (``actor.optim.lr=1e-5``) fill these dataclasses; the
loader (:mod:`fitrl.config.loader`) rejects unknown keys with the nearest valid key and
wrong types with the expected type. Every field carries a docstring: ``fitrl config --doc``
prints them. Cross-field checks live in ``__post_init__`` and say what to change; nothing
here copies one field into another behind the user's back.

Batch sizes have one definition (docs/architecture.md, "Batch sizes"):
  data.rollout_batch_size  prompts drawn per RL step
  rollout.n                responses sampled per prompt (a step makes rollout_batch_size * n sequences)
  actor.mini_batch_size    prompts per optimizer step
  actor.micro_batch_size   sequences per forward/backward; gradient accumulation fills the mini-batch
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from fitrl.config.batch_sizes import BatchSizes
from fitrl.config.plan import PlanConfig
from fitrl.config.algorithm import (AlgorithmConfig, DistillConfig, FilterGroupsConfig, KLRewardConfig, OverlongConfig,
                                    RewardConfig, RolloutCorrectionConfig)
from fitrl.config.data import DataConfig
from fitrl.config.roles import (ActorConfig, CriticConfig, FSDPConfig, LoRAConfig, ModelConfig, OptimConfig, RefConfig,
                                TeacherConfig)
from fitrl.config.rollout import RolloutConfig, SamplingConfig
from fitrl.config.run import CheckpointConfig, MemoryConfig, TrainerConfig
from fitrl.core.errors import ConfigError

__all__ = ["ActorConfig", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "CriticConfig", "DataConfig",
           "DistillConfig", "FSDPConfig", "FilterGroupsConfig", "FitrlConfig", "KLRewardConfig", "LoRAConfig", "MemoryConfig", "ModelConfig",
           "OptimConfig", "OverlongConfig", "PlanConfig", "RefConfig", "RewardConfig", "RolloutConfig",
           "RolloutCorrectionConfig", "SamplingConfig", "TeacherConfig", "TrainerConfig", "check_batch_sizes", "check_critic_batch_sizes",
           "derived_batch_numbers"]


MODEL_ROLES = ("actor", "ref", "critic", "teacher")
"""The sections of the roles built from ``<role>.model`` with ``<role>.fsdp`` options."""


def default_mixed_precision(role: str, device_type: str, backend: str) -> bool:
    """Whether ``role`` computes in bf16 (``<role>.fsdp.mixed_precision``) when the config leaves
    it unset. On CUDA yes: bf16 tensor cores run about twice fp32's (TF32) rate and the activations
    take half the memory, while the master weights, gradients' reduction and AdamW stay fp32; the
    engine then computes in bf16 too (``PolicyWorker.engine_context``). On CPU no: most CPUs lack
    bf16 GEMM kernels, and CPU runs stay as they were. A critic in one process: no (its bf16 needs
    FSDP2, ``trainer.backend=ray``)."""
    if device_type != "cuda":
        return False
    return not (role == "critic" and backend == "inprocess")


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
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen teacher of on-policy distillation (built only when ``algorithm.distill.weight > 0``)."""
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
    plan: PlanConfig = field(default_factory=PlanConfig)
    """What the memory planner reads beyond the run's keys: ``fitrl plan``'s hardware, and ``plan.emulate``: behaviours of another framework (its vLLM integration, its checkpoint loading) that fitrl never has, to reproduce a reported run. The rollout engine is planned from the run's own ``rollout.*`` keys (``engine``, ``gpu_memory_utilization``, ``kv_cache_memory``, ``tensor_parallel_size``, ``sleep_level``), images from ``data.max_pixels`` and ``data.limit_images``. The trainer ignores ``plan.hardware`` (it detects the hardware it runs on)."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks of every trained role."""
        t = self.trainer
        return t.nnodes * t.devices_per_node if t.backend == "ray" else 1

    @property
    def old_logprob_source(self) -> str:
        """Where the update's behaviour log-probs come from: ``pass`` (the actor's forward over
        every sequence before the update), ``update`` (the update's own forward, detached:
        ``algorithm.fold_old_logprob`` with one optimizer step per RL step) or ``rollout`` (the
        engine's, ``algorithm.recompute_old_logprob=false``)."""
        a = self.algorithm
        if not a.recompute_old_logprob:
            return "rollout"
        one_step = self.actor.ppo_epochs == 1 and self.actor.mini_batch_size == self.data.rollout_batch_size
        return "update" if a.fold_old_logprob and one_step and not a.kl_in_reward.enable else "pass"

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train on different sequences: the world over ``actor.ulysses_size`` (the
        ranks of a sequence-parallel group hold the same ones)."""
        return self.world_size // self.actor.ulysses_size

    def with_device_defaults(self, device_type: str) -> "FitrlConfig":
        """This config with the defaults that depend on the device the run computes on filled in
        (``device_type``: ``cuda`` or ``cpu``; the trainer's resolved ``trainer.device``, the
        planner's ``plan.hardware.device``): each role's unset ``fsdp.mixed_precision``
        (:func:`default_mixed_precision`). A shallow copy; what the user set is kept."""
        roles = {}
        for role in MODEL_ROLES:
            section = getattr(self, role)
            if section.fsdp.mixed_precision is None:
                on = default_mixed_precision(role, device_type, self.trainer.backend)
                roles[role] = dataclasses.replace(section, fsdp=dataclasses.replace(section.fsdp, mixed_precision=on))
        if not roles:
            return self
        out = copy.copy(self)  # (not replace(): __post_init__'s checks have run on these values)
        for role, section in roles.items():
            setattr(out, role, section)
        return out

    def autocast_dtype(self, role: str) -> str | None:
        """``bfloat16`` where ``<role>.fsdp.mixed_precision`` runs without FSDP2 (one process):
        the role's forwards run under ``torch.autocast`` on its fp32 weights. None otherwise
        (under FSDP2 its MixedPrecisionPolicy does the casting)."""
        on = self.trainer.backend == "inprocess" and getattr(self, role).fsdp.mixed_precision
        return "bfloat16" if on else None

    def __post_init__(self) -> None:
        check_sequence_parallel(self)
        check_rollout_placement(self)
        check_batch_sizes(self, world_size=self.data_parallel_size)
        check_distill(self)
        check_routing_replay(self)
        if self.trainer.backend == "inprocess":
            for role in MODEL_ROLES:
                f = getattr(self, role).fsdp
                # (mixed precision of the actor and the reference: torch.autocast in one process)
                if (f.mixed_precision and role == "critic") or f.cpu_offload or f.strategy == "hybrid":
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
        for key, value, cap_key, cap in (
                ("expected_prompt_length", self.plan.expected_prompt_length, "data.max_prompt_length",
                 self.data.max_prompt_length),
                ("expected_response_length", self.plan.expected_response_length, "rollout.max_response_length",
                 self.rollout.max_response_length)):
            if isinstance(value, int) and value > cap:  # a typical length beyond the cap cannot happen
                raise ConfigError(f"plan.{key}={value} is longer than {cap_key}={cap}: lower it to {cap} or less "
                                  f"(null: the cap)")
        c, t = self.checkpoint, self.trainer
        if c.keep_best is not None:
            if not self.data.val_files:
                raise ConfigError(f"checkpoint.keep_best={c.keep_best} needs validation: set data.val_files")
            if c.save_freq and (not t.val_freq or c.save_freq % t.val_freq):
                raise ConfigError(f"checkpoint.keep_best ranks checkpoints by a validation metric, but "
                                  f"trainer.val_freq={t.val_freq} does not divide checkpoint.save_freq={c.save_freq}: "
                                  f"set trainer.val_freq={c.save_freq}")


def check_distill(cfg: FitrlConfig) -> None:
    """``algorithm.distill`` against the teacher it needs (the teacher's tokenizer and vocabulary
    against the actor's are checked with the model directories: fitrl/models/teacher_check.py)."""
    d = cfg.algorithm.distill
    if d.enabled and (cfg.teacher.model is None or not cfg.teacher.model.path):
        raise ConfigError(f"algorithm.distill.weight={d.weight:g} distills from a teacher, and none is set: set "
                          "teacher.model.path to the teacher's model directory (or Hub id), or "
                          "algorithm.distill.weight=0 for pure RL")
    if d.enabled and d.loss == "topk_forward_kl" and cfg.actor.ulysses_size > 1:
        raise ConfigError(f"algorithm.distill.loss=topk_forward_kl with actor.ulysses_size={cfg.actor.ulysses_size}: "
                          "the student's top-k pass has no sequence parallelism yet; use algorithm.distill.loss="
                          "reverse_kl, or actor.ulysses_size=1")


def check_routing_replay(cfg: FitrlConfig) -> None:
    """``actor.routing_replay`` needs rollouts that carry each sampled token's experts (a MoE
    policy itself is checked when the actor is built: fitrl/roles/moe.py)."""
    if not cfg.actor.routing_replay:
        return
    r = cfg.rollout
    if not r.capabilities.records_routing:
        raise ConfigError(f"actor.routing_replay=true needs an engine that records each sampled token's experts, and "
                          f"rollout.engine={r.engine} does not; use rollout.engine=hf, or actor.routing_replay=false")
    if r.agent.enabled:
        raise ConfigError("actor.routing_replay=true with rollout.agent: multi-turn episodes do not carry the "
                          "engine's routing yet; set actor.routing_replay=false")


def check_rollout_placement(cfg: FitrlConfig) -> None:
    """``rollout.mode`` and ``rollout.workers`` (docs/async.md): an overlapped mode gets a rollout
    worker when none is set, and its stale samples a PPO ratio against the weights that sampled
    them when nothing else would correct for their age."""
    r, a = cfg.rollout, cfg.algorithm
    if r.mode != "sync" and r.workers == 0:
        r.workers = 1
        adjusted(cfg, f"rollout.mode={r.mode} overlaps generation with the update, which needs a rollout worker "
                      "of its own: rollout.workers set to 1")
    if r.mode != "sync" and a.filter_groups.enable:
        # its extra rounds would draw prompts after the later steps' draws, which a checkpoint's
        # sampler state (taken before those draws) could not replay without repeating them
        raise ConfigError(f"algorithm.filter_groups (dynamic sampling) draws more prompts during a step, while "
                          f"rollout.mode={r.mode} has already drawn the next steps'; use rollout.mode=sync "
                          f"(rollout.workers keeps generation on processes of its own)")
    if r.workers and r.tensor_parallel_size > 1 and r.capabilities.tensor_parallel:
        raise ConfigError(f"rollout.workers={r.workers} with rollout.tensor_parallel_size={r.tensor_parallel_size}: a "
                          f"rollout worker of its own runs one engine on one device so far; set "
                          f"rollout.tensor_parallel_size=1, or rollout.workers=0 and rollout.mode=sync (engines "
                          f"colocated with the policy's ranks take any tensor_parallel_size)")
    if r.workers and r.weight_transport == "collective" and cfg.trainer.backend != "ray":
        raise ConfigError(f"rollout.weight_transport=collective needs trainer.backend=ray (with "
                          f"trainer.backend={cfg.trainer.backend} the rollout worker is a thread of the trainer's "
                          f"process and takes its tensors without a copy); set rollout.weight_transport=auto")
    if r.mode != "sync" and a.recompute_old_logprob and a.rollout_correction.mode == "off":
        # recomputed (or folded) old log-probs are the current weights': the ratio of a single
        # optimizer step is then 1 and nothing bounds the update against the weights that sampled;
        # the sampling log-probs as the ratio's denominator make PPO's clip that bound
        # (bench/RESULTS.md, "Asynchronous rollout": the recomputed ratio with token TIS collapsed)
        a.recompute_old_logprob = False
        adjusted(cfg, f"rollout.mode={r.mode} trains on samples of older weights: the PPO ratio is taken against "
                      "the sampling log-probs (algorithm.recompute_old_logprob=false), so the clip bounds each update "
                      "relative to the weights that generated the samples; algorithm.rollout_correction.mode=token "
                      "recomputes them and weighs by truncated importance sampling instead")


def check_sequence_parallel(cfg: FitrlConfig) -> None:
    """``actor.ulysses_size`` against the world and the roles (its model's heads are checked with
    the model's config.json: fitrl/models/check.py)."""
    u, world = cfg.actor.ulysses_size, cfg.world_size
    if u == 1:
        return
    if u > world or world % u:
        raise ConfigError(f"actor.ulysses_size={u} must divide the world size ({world} rank(s): trainer.nnodes x "
                          f"trainer.devices_per_node under trainer.backend=ray); use a divisor of {world}")
    if cfg.algorithm.adv_estimator == "gae":
        raise ConfigError("actor.ulysses_size > 1 with algorithm.adv_estimator=gae: the critic has no sequence "
                          "parallelism yet; use actor.ulysses_size=1, or an estimator without a critic (grpo, rloo)")


def check_batch_sizes(cfg: FitrlConfig, world_size: int) -> None:
    """Divisibility of the batch sizes (docs/architecture.md, "Batch sizes"), with what to change when it fails."""
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
    sizes = BatchSizes.of(cfg, world_size)
    seqs_per_rank = sizes.mini_batch_per_rank
    if sizes.sequences_per_mini_batch % world_size:
        raise ConfigError(
            f"a mini-batch of {mini} prompts x {n} samples = {mini * n} sequences does not split over "
            f"{world_size} ranks: make actor.mini_batch_size * rollout.n a multiple of {world_size}"
        )
    ranks = f" / {world_size} ranks" if world_size > 1 else ""
    if micro > seqs_per_rank:  # a memory knob: a micro-batch larger than the mini-batch is the mini-batch
        cfg.actor.micro_batch_size = micro = seqs_per_rank
        adjusted(cfg, f"actor.micro_batch_size is larger than a mini-batch's {seqs_per_rank} sequences per rank "
                      f"(actor.mini_batch_size={mini} x rollout.n={n}{ranks}): using {seqs_per_rank}")
    if seqs_per_rank % micro:
        raise ConfigError(
            f"a mini-batch has {seqs_per_rank} sequences per rank (actor.mini_batch_size={mini} x "
            f"rollout.n={n}{ranks}), not a multiple of actor.micro_batch_size={micro}: "
            f"set actor.micro_batch_size to a divisor of {seqs_per_rank} "
            f"(e.g. {_largest_divisor_at_most(seqs_per_rank, micro)})"
        )


def check_critic_batch_sizes(cfg: FitrlConfig, world_size: int) -> None:
    """Checked only when a critic is built (its defaults need not fit runs without one)."""
    c, rbs = cfg.critic, cfg.data.rollout_batch_size
    if rbs % c.mini_batch_size:
        raise ConfigError(f"data.rollout_batch_size={rbs} is not a multiple of critic.mini_batch_size="
                          f"{c.mini_batch_size}: set critic.mini_batch_size to a divisor of {rbs}")
    sizes = BatchSizes.of(cfg, world_size, role="critic")
    seqs, per_rank = sizes.sequences_per_mini_batch, sizes.mini_batch_per_rank
    if not seqs % world_size and c.micro_batch_size > per_rank:  # (as the actor's, above)
        c.micro_batch_size = per_rank
        adjusted(cfg, f"critic.micro_batch_size is larger than a critic mini-batch's {per_rank} sequences "
                      f"per rank: using {per_rank}")
    if seqs % world_size or (seqs // world_size) % c.micro_batch_size:
        raise ConfigError(f"a critic mini-batch has {seqs} sequences (critic.mini_batch_size x rollout.n) over "
                          f"{world_size} rank(s): make it a multiple of critic.micro_batch_size={c.micro_batch_size}")


def adjusted(cfg: FitrlConfig, text: str) -> None:
    """Note a value the config load changed because the given one cannot be used as it is (said
    once at start-up: :func:`adjustments`)."""
    notes = cfg.__dict__.setdefault("_adjustments", [])
    if text not in notes:
        notes.append(text)


def adjustments(cfg: FitrlConfig) -> list[str]:
    """What the config load changed (:func:`adjusted`), one line each."""
    return list(cfg.__dict__.get("_adjustments", []))


def _largest_divisor_at_most(total: int, limit: int) -> int:
    return max(d for d in range(1, min(total, limit) + 1) if total % d == 0)


def derived_batch_numbers(cfg: FitrlConfig, world_size: int = 1) -> dict[str, int]:
    """The numbers printed at start-up so nobody has to derive them by hand."""
    return BatchSizes.of(cfg, world_size).printout()
