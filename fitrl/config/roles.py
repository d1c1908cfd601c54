"""The sections of the models and their roles: the model, its optimizer, FSDP and LoRA, and the
actor, critic, reference and teacher. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from fitrl.core.errors import ConfigError

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
    fused: bool = True
    """torch's fused AdamW kernel (all tensors in one kernel, CPU and CUDA) where every trained parameter is a floating tensor on a device it supports, else torch's default implementation. On 32M fp32 parameters, one thread: 0.20 s per step against 0.84 s (``bench/optimizer_step.py``). The same update up to float rounding; checkpoints are interchangeable."""

    def check(self, prefix: str) -> None:
        """The optimizer's values, named under ``prefix`` (``actor.optim``, ``critic.optim``): the
        sections that own an optimizer call this, since only they know the key's full name."""
        # `not x > 0` rather than `x <= 0`: a NaN built in code (the loader already refuses
        # non-finite floats) fails it too, instead of training a model into NaN weights.
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"{prefix}.lr must be a finite number > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{prefix}.betas must be two values in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ConfigError(f"{prefix}.eps must be > 0, got {self.eps}")
        for name in ("weight_decay", "grad_clip", "warmup_steps"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{prefix}.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{prefix}.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class ModelConfig:
    path: str = ""
    """A local Hugging Face model directory (config.json, weights, tokenizer), or a Hub id ``org/name`` / ``org/name@revision`` (a branch, tag or commit) resolved through the Hugging Face cache (``HF_HOME``, ``HF_HUB_CACHE``): downloaded into it unless ``HF_HUB_OFFLINE=1``, once per run, the commit recorded in the run directory's ``hub_refs.json`` (docs/hub.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are held in (the actor's are its master weights, so keep float32 there)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory (or Hub id) when it differs from ``path``."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (trades ~30% more compute for far less activation memory)."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``)."""
    freeze_vision_tower: bool = False
    """Vision-language models: keep the vision encoder (and its merger) frozen: no gradients and no optimizer state for it."""


@dataclass
class FSDPConfig:
    strategy: Literal["full", "hybrid"] = "full"
    """``full``: shard over all ranks; ``hybrid``: shard within a node, replicate across nodes."""
    init: Literal["rank0", "every_rank"] = "rank0"
    """``rank0``: rank 0 reads the checkpoint and broadcasts into the shards (host memory ~ one copy per node); ``every_rank``: each rank reads it."""
    mixed_precision: Optional[bool] = None
    """bf16 compute on fp32 master weights; unset: on where the run computes on CUDA, off on CPU (``default_mixed_precision`` in fitrl/config/schema.py; a critic in one process: off).  Under FSDP2 (``trainer.backend=ray``): bf16 parameters for compute and all-gather, fp32 gradient reduction (MixedPrecisionPolicy). In one process (``inprocess``, actor and reference): every forward (generation, log-probs, the update's) under ``torch.autocast`` to bf16, which holds a bf16 copy of the weights while a forward runs. On a CPU without bf16 GEMM kernels (no AVX-512 or AMX: PyTorch's bf16 ``mm`` there runs at 1-3 GFLOP/s) the bf16 products run in the fp32 kernel on the same bf16 operands and are rounded once to bf16 (fitrl/core/bf16_matmul.py)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: shards, gradients and optimizer step live in host memory, copied to the device per layer."""
    offload_params: bool = False
    """Move this role's parameter shards to host memory between its phases (e.g. during rollout) and back."""
    offload_optimizer: bool = False
    """Move optimizer states to host memory between updates."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank of the adapters on the policy (0: off, every parameter trains). With LoRA only the
    adapters train (their gradients and AdamW states are all the optimizer holds), and with KL on
    the reference log-probs come from the same weights with the adapters disabled: no reference
    model is built."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapter's update is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 keeps rollout and training log-probs identical)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters: module names (``q_proj``, ``v_proj``, ...) or ``all-linear``
    (every linear layer except the output head)."""
    seed: int = 0
    """Seed of the adapters' initialisation (the same on every rank)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"actor.lora needs rank >= 0 (0: off), alpha > 0 and dropout in [0, 1); got "
                              f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}")
        if not self.target_modules:
            raise ConfigError("actor.lora.target_modules is empty: name linear layers (q_proj, v_proj, ...) "
                              "or use all-linear")


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
    """When > 0, micro-batches (update and log-prob) are formed by tokens instead: sequences of similar length grouped so that each micro-batch's padded size (sequences x its longest, what a forward holds) stays within this many prompt+response tokens (a longer sequence alone), as few as that allows, and the same number on every rank. 0 uses the sequence counts above."""
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
    """Shuffle sequences before splitting into mini-batches (scatters a prompt's samples over the micro-batches: less for ``share_prompts`` to share)."""
    share_prompts: bool = True
    """Log-prob and update forwards (the policy's and the reference's) run a prompt shared by rows of a micro-batch (a group's samples) through the model once, its keys and values reused by every row (fitrl/ops/shared_prompt.py): the same log-probs and gradients to rounding, fewer tokens through the model (``bench/vs_trl.py``: 42 % of an update's tokens were prompt copies). Off, or not applied, for images, sliding-window attention and gradient checkpointing in the update."""
    packing: bool = True
    """Padding-free forwards: the log-prob and update passes (the policy's and the reference's) run each micro-batch's real tokens packed end to end in rows as wide as its longest sequence, positions restarting per sequence and attention kept within it (fitrl/ops/packed.py), instead of every row padded to the widest prompt plus the widest response: the same log-probs and gradients to rounding, fewer positions through the model when lengths vary. Each micro-batch takes whichever of packed, shared-prompt and padded runs the fewest positions. Not applied for images (a multimodal rope) or sliding-window attention."""
    ulysses_size: int = 1
    """Ulysses sequence parallelism (trainer.backend=ray): every this many consecutive ranks hold the same micro-batches and each runs a 1/ulysses_size chunk of every (packed) sequence, attention heads exchanged all-to-all (fitrl/distributed/ulysses.py), so a sequence's activations are split over the group: the log-prob passes (the policy's and the reference's) and the update. Must divide the world size and the model's attention and key/value heads; data parallelism is then world size / ulysses_size. Text models with sdpa or eager attention, no sliding window, no critic yet."""
    sharding: str = "fsdp2"
    """How the actor is sharded over its ranks under the Ray backend: a registered sharding backend (``fsdp2``: FSDP2, options in ``actor.fsdp``; docs/architecture.md, "Adding a sharding backend")."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the actor (used by the Ray backend)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters on the policy (``actor.lora.rank > 0``), through PEFT."""
    router_aux_loss_coef: Optional[float] = None
    """A mixture-of-experts policy: the weight of the router's load-balancing loss in the update (transformers' ``load_balancing_loss_func``, logged as ``actor/router_aux_loss``; fitrl/roles/moe.py); unset: the model's own ``router_aux_loss_coef`` (Qwen3-MoE's config default: 0.001). Ignored for a dense policy."""
    routing_replay: bool = False
    """A mixture-of-experts policy: every training forward (old log-probs, reference, update) runs each response token on the experts the rollout engine chose for it (recorded by the HF engine; "rollout routing replay"), so that the trainer's log-probs of the sampled tokens are the engine's; ``moe/routing_mismatch`` still reports how often the router would have chosen otherwise."""

    def __post_init__(self) -> None:
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ConfigError(f"actor.router_aux_loss_coef must be >= 0 (unset: the model's), got "
                              f"{self.router_aux_loss_coef}")
        if self.model.dtype != "float32":
            # AdamW stepping bf16 weights rounds most updates away (measured: 2% of a tiny
            # model's parameters changed after one step at lr 1e-6); mixed precision keeps fp32
            # master weights and computes in bf16, which arrives with FSDP2.
            raise ConfigError(f"actor.model.dtype={self.model.dtype} would make AdamW update low-precision "
                              "weights directly; keep actor.model.dtype=float32 (ref.model.dtype may be bfloat16)")
        for name in ("ppo_epochs", "logprob_micro_batch_size", "logprob_chunk_size", "ulysses_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"actor.{name} must be >= 1, got {getattr(self, name)}")
        self.optim.check("actor.optim")


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
    packing: bool = True
    """Padding-free value forwards where they run fewer positions (as ``actor.packing``)."""
    ppo_epochs: int = 1
    """Critic passes over the batch per RL step."""
    cliprange_value: float = 0.5
    """Clip range of the value update around the old values."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token value loss."""
    warmup_steps: int = 0
    """RL steps at the start during which only the critic learns (the actor is not updated)."""
    sharding: str = "fsdp2"
    """How the critic is sharded over its ranks under the Ray backend: a registered sharding backend (``fsdp2``: FSDP2, options in ``critic.fsdp``; docs/architecture.md, "Adding a sharding backend")."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the critic (used by the Ray backend)."""

    def __post_init__(self) -> None:
        self.optim.check("critic.optim")


@dataclass
class FrozenRoleConfig:
    """What the frozen roles that score the policy's samples share: the reference and the teacher."""
    model: Optional[ModelConfig] = None
    """The role's model (each role's section says what unset means)."""
    logprob_micro_batch_size: int = 16
    """Sequences per forward when computing the role's log-probs (the teacher's top-k too)."""
    sharding: str = "fsdp2"
    """How the role's model is sharded over its ranks under the Ray backend: a registered sharding backend (``fsdp2``: FSDP2, options in the section's ``fsdp``, ``ref.fsdp`` or ``teacher.fsdp``; docs/architecture.md, "Adding a sharding backend")."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the role's model (used by the Ray backend; in one process, ``mixed_precision`` is autocast)."""


@dataclass
class RefConfig(FrozenRoleConfig):
    model: Optional[ModelConfig] = None
    """Reference model; when unset, a frozen copy of the actor's initial model (same path and dtype)."""


@dataclass
class TeacherConfig(FrozenRoleConfig):
    model: Optional[ModelConfig] = None
    """The teacher of on-policy distillation (``algorithm.distill``): a local model directory or Hub id, loaded as every role's model, frozen. It scores the student's own samples token by token, so it must share the actor's tokenizer (checked before anything loads). Built only when ``algorithm.distill.weight > 0``."""

    def __post_init__(self) -> None:
        if self.logprob_micro_batch_size < 1:
            raise ConfigError(f"teacher.logprob_micro_batch_size must be >= 1, got {self.logprob_micro_batch_size}")
