"""Config sections of the models and their roles: data, actor (model, optimizer, FSDP), reference,
critic, and rollout sampling. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from fitrl.config.plan import parse_bytes
from fitrl.core.errors import ConfigError


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
    source_key: str = "data_source"
    """Column naming the benchmark or source a row comes from (e.g. ``gsm8k``); when validation rows carry it, ``val/*`` metrics are also split by it (``val/by_source/<source>/...``)."""
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
    # Vision-language data (read when the policy is a vision-language family; docs/vision.md)
    image_key: str = "images"
    """Column holding a row's images: a path (relative to ``data.image_dir``), raw bytes, a ``datasets`` Image value (``{'bytes', 'path'}``), or a list of them. A row without it (or null, or []) has no image."""
    image_dir: Optional[str] = None
    """Directory that relative image paths are read from (default: the directory of the data file holding the row)."""
    image_placeholder: str = "<image>"
    """Text in the prompt that marks where each image goes (in order); a row with images and no placeholder gets them before its text."""
    min_pixels: int = 3136
    """Images smaller than this many pixels are upscaled (aspect kept) to at least this; with ``max_pixels`` this is the pixel budget the dataset, the processor, the rollout and the plan share."""
    max_pixels: int = 1048576
    """Images larger than this many pixels are downscaled (aspect kept) to at most this before the processor; sets the image tokens per image (about max_pixels / 784 for Qwen2/2.5-VL, / 1024 for Qwen3-VL)."""
    limit_images: int = 4
    """Most images (and videos) one prompt may hold; a row with more is a bad row (``data.on_bad_image``)."""
    on_bad_image: Literal["error", "skip"] = "error"
    """A missing, corrupt, empty or oversized image, or a row with more images than ``limit_images`` or placeholders than images: ``error`` stops at start-up naming the file and row; ``skip`` drops the row and reports how many were dropped and why."""
    max_image_side: int = 16384
    """Images whose width or height (as the file header says) exceed this are refused before decoding (decompression bombs)."""
    video_key: str = "videos"
    """Column holding a row's videos, each a list of frames (any image form above); the prompt marks each with ``data.video_placeholder``."""
    video_placeholder: str = "<video>"
    """Text in the prompt that marks where each video goes."""
    video_fps: float = 2.0
    """Frames per second of the frame lists in ``data.video_key`` (sets the temporal position step of Qwen2.5-VL)."""
    max_frames: int = 16
    """Longer frame lists are subsampled evenly to this many frames."""
    video_max_pixels: int = 65536
    """Per-frame pixel budget of videos (frames are downscaled to at most this many pixels)."""

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "max_image_side", "max_frames", "video_max_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}")
        if self.limit_images < 0:
            raise ConfigError(f"data.limit_images must be >= 0, got {self.limit_images}")
        if not (math.isfinite(self.video_fps) and self.video_fps > 0):
            raise ConfigError(f"data.video_fps must be > 0, got {self.video_fps}")
        if not self.image_placeholder or not self.video_placeholder or self.image_placeholder == self.video_placeholder:
            raise ConfigError("data.image_placeholder and data.video_placeholder must be non-empty and different")


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
    """Local Hugging Face model directory (config.json, weights, tokenizer). Nothing is downloaded."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype the weights are held in (the actor's are its master weights, so keep float32 there)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory when it differs from ``path``."""
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
    mixed_precision: bool = False
    """bf16 compute on fp32 master weights. Under FSDP2 (``trainer.backend=ray``): bf16 parameters for compute and all-gather, fp32 gradient reduction (MixedPrecisionPolicy). In one process (``inprocess``, actor and reference): every forward (generation, log-probs, the update's) under ``torch.autocast`` to bf16, which holds a bf16 copy of the weights while a forward runs. On a CPU without bf16 GEMM kernels (no AVX-512 or AMX: PyTorch's bf16 ``mm`` there runs at 1-3 GFLOP/s) the bf16 products run in the fp32 kernel on the same bf16 operands and are rounded once to bf16 (fitrl/core/bf16_matmul.py)."""
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
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Sharding, mixed precision and offload of the actor (used by the Ray backend)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters on the policy (``actor.lora.rank > 0``), through PEFT."""

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

    def __post_init__(self) -> None:
        self.optim.check("critic.optim")


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
    """How one generate call samples: what every rollout engine takes (training and validation)."""

    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 disables)."""
    n: int = 1
    """Responses sampled per prompt."""
    max_tokens: Optional[int] = None
    """New tokens per response at most; unset: ``rollout.max_response_length``."""
    ignore_eos: bool = False
    """Never stop at EOS: every response is ``max_tokens`` long (benchmarks, memory tests)."""

    def __post_init__(self) -> None:
        check_sampling(self, "rollout.val")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling(s, prefix: str, training: bool = False) -> None:
    """The one set of sampling checks, for ``rollout.*`` (training) and ``rollout.val.*``."""
    if training and s.temperature <= 0:
        raise ConfigError(
            f"{prefix}.temperature must be > 0 for training (policy-gradient log-probs need a"
            " sampling distribution); use rollout.val.temperature=0 for greedy validation"
        )
    if s.temperature < 0:
        raise ConfigError(f"{prefix}.temperature must be >= 0 (0 = greedy), got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"{prefix}.top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ConfigError(f"{prefix}.top_k must be >= 0 (0 disables), got {s.top_k}")
    if not training and s.n < 1:  # training's n is checked with the batch sizes
        raise ConfigError(f"{prefix}.n must be >= 1, got {s.n}")
    if getattr(s, "max_tokens", None) is not None and s.max_tokens < 1:
        raise ConfigError(f"{prefix}.max_tokens must be >= 1 (or unset), got {s.max_tokens}")


@dataclass
class RolloutConfig:
    engine: str = "hf"
    """Generation engine, a name registered in ``fitrl.rollout.engine.ROLLOUT_ENGINES``: ``hf`` (transformers ``generate`` on the trained module; CPU and GPU) or
    ``vllm`` (a vLLM engine colocated with each policy rank, weights pushed after every update;
    ``pip install fitrl[vllm]``, docs/vllm.md). Engines implement
    :class:`fitrl.rollout.engine.RolloutEngine`; see docs/architecture.md for adding one."""
    gpu_memory_utilization: float = 0.6
    """vLLM on a GPU: fraction of each device's memory the engine takes while awake (weights + KV cache + activations); ignored when ``kv_cache_memory`` is set."""
    kv_cache_memory: Optional[str] = None
    """vLLM: the KV cache's size as a byte count (e.g. ``2GiB``) instead of a share of the device; on CPU the default is 256MiB (vLLM's own CPU default takes several GiB)."""
    tensor_parallel_size: int = 1
    """vLLM: TP shards per engine. With several policy ranks, that many consecutive ranks share one engine, a shard (and a GPU) each, so the ranks must be a multiple of it; with one policy rank, the engine's TP workers are processes of its own (docs/vllm.md)."""
    sleep_level: Literal[0, 1, 2] = 1
    """vLLM between rollouts (GPU only): 0 stays awake, 1 frees the KV cache and keeps the weights in pinned host memory (2 bytes/param/GPU in bf16), 2 frees both (the weights come back by the next push)."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs (less memory and a faster start, slower decoding); always eager on CPU."""
    enable_prefix_caching: bool = True
    """vLLM: reuse the KV of shared prompt prefixes within a rollout (reset after every weight push)."""
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
    decode: Literal["loop", "generate"] = "loop"
    """``hf`` engine: how a micro-batch is decoded. ``loop``: fitrl's loop on the model's forward
    (:mod:`fitrl.rollout.decode`), in which finished sequences leave the batch and its KV cache
    and tokens are drawn by inverse CDF. On CPU (tiny and small qwen2, 2 threads) 1.2x the
    tokens/s of ``generate`` with EOS ignored (``bench/rollout_engines.py --engines hf --decode
    generate loop``), 2.1-2.3x when responses end at spread lengths (mean ~36 of 128 tokens).
    ``generate``: transformers ``generate``. Both sample with the same math (same distribution,
    same recorded log-probs; greedy outputs identical), not the same tokens under one seed.
    Vision-language models, and models with sliding-window or linear attention, always use
    ``generate``."""
    ignore_eos: bool = False
    """Never stop at EOS: every response is ``max_response_length`` tokens (benchmarks, memory tests)."""
    val: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, n=1))
    """Sampling for validation (greedy, one response per prompt, by default)."""

    def __post_init__(self) -> None:
        check_sampling(self, "rollout", training=True)
        if self.max_response_length < 1 or self.micro_batch_size < 1:
            raise ConfigError("rollout.max_response_length and rollout.micro_batch_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_memory is not None:
            if parse_bytes(self.kv_cache_memory, "rollout.kv_cache_memory") <= 0:
                raise ConfigError("rollout.kv_cache_memory must be a positive size, e.g. 2GiB")

    def sampling(self) -> SamplingConfig:
        """Training-time sampling as the engines take it."""
        return SamplingConfig(self.temperature, self.top_p, self.top_k, self.n, self.max_response_length,
                              self.ignore_eos)

    def val_sampling(self) -> SamplingConfig:
        """Validation sampling, its length bounded by ``max_response_length`` unless set."""
        v = self.val
        return SamplingConfig(v.temperature, v.top_p, v.top_k, v.n, v.max_tokens or self.max_response_length,
                              v.ignore_eos)
