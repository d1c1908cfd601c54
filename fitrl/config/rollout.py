"""The ``rollout`` section: sampling (defined once, :class:`Sampling`, for training and
validation) and the engine that generates. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal, Optional

from fitrl.config.agent import AgentConfig
from fitrl.config.plan import parse_bytes
from fitrl.core.engines import EngineCapabilities, engine_capabilities
from fitrl.core.errors import ConfigError

@dataclass
class Sampling:
    """The sampling fields, defined once: training (``rollout.*``) and validation (``rollout.val.*``)
    sample with them, and every rollout engine takes them as a :class:`SamplingConfig`."""

    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding (validation only: training needs > 0, and its log-probs are computed at this temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 disables)."""
    n: int = 1
    """Responses sampled per prompt."""
    ignore_eos: bool = False
    """Never stop at EOS: every response is as long as the length cap allows (benchmarks, memory tests)."""


@dataclass
class SamplingConfig(Sampling):
    """How one generate call samples: what every rollout engine takes (training and validation)."""

    max_tokens: Optional[int] = None
    """New tokens per response at most; unset: ``rollout.max_response_length``."""

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


DEFAULT_ENGINE = "hf"
"""``rollout.engine`` unless set: an engine that computes with the trained module, so it is also
what the policy's ranks run beside rollout workers whose engine holds its own weights
(:attr:`RolloutConfig.trainer_engine`; fitrl/trainer/complete.py checks it declares so)."""


@dataclass
class RolloutConfig(Sampling):
    """Training-time sampling (the :class:`Sampling` fields: ``rollout.temperature``, ``top_p``,
    ``top_k``, ``n``, ``ignore_eos``; log-probs are computed at this temperature) and the engine
    that generates."""

    engine: str = DEFAULT_ENGINE
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
    sleep_level: Literal["auto", 0, 1, 2] = "auto"
    """vLLM between rollouts (GPU only): 0 stays awake, 1 frees the KV cache and keeps the weights in pinned host memory (2 bytes/param/GPU in bf16), 2 frees both (the weights come back by the next push). ``auto``: 2 in a training run, whose every update pushes the weights (they would overwrite level 1's host copy before the next rollout; a wake with no push since, another sampling round or validation, pushes again: a gather over the devices' links instead of a copy over PCIe), 1 with ``trainer.val_only`` (nothing is pushed after the first wake). The engine's first line says which level and why. An engine that sleeps does so right after it is built, so that the roles loading after it (reference, critic, reward models) find its memory free."""
    mismatch_stop_kl: float = 0.1
    """Stop the run when, right after a weight push and a wake, the engine computes other log-probs than the trainer for the step's sampled tokens: ``rollout/kl`` (the k3 KL(pi_rollout || pi_trainer) per token, fitrl/algo/mismatch.py) above this floor and above ``mismatch_stop_factor`` times its median over the run's last steps (fitrl/trainer/stops.py). A sound engine sits near 1e-6 (fp32) to 1e-3 (a bf16 vLLM engine against an fp32 trainer); corrupted weights (a push or a wake that went wrong) near 1 and above. The run stops with one line naming the step, the engine and the push; the step is not checkpointed, so the last checkpoint is the one before it (``trainer.max_restarts`` rebuilds the engine and resumes from there). Needs the trainer's log-probs of the samples (not ``algorithm.recompute_old_logprob=false``); 0 disables."""
    mismatch_stop_factor: float = 10.0
    """The jump ``mismatch_stop_kl`` looks for: ``rollout/kl`` at least this many times its median over the run's last steps (the engine's usual distance from the trainer: precision, kernels, and in overlapped modes the weights' age)."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs (less memory and a faster start, slower decoding); always eager on CPU."""
    enable_prefix_caching: bool = True
    """vLLM: reuse the KV of shared prompt prefixes within a rollout (reset after every weight push)."""
    n: int = 8
    """Responses sampled per prompt during training (the GRPO group size)."""
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
    val: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, n=1))
    """Sampling for validation (greedy, one response per prompt, by default)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes with an environment and tools (docs/agents.md); off unless ``rollout.agent.env`` is set."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """How generation and training overlap (docs/async.md). ``sync``: each step generates, then trains on what it generated (on-policy). ``one_step_off``: the rollout workers generate step k+1's samples with the weights before update k while the trainer runs update k (every sample one update old). ``async``: the rollout workers stay up to ``max_staleness`` steps ahead and take each new version of the weights between micro-batches (partial rollouts), so a step's samples may come from several versions. Both overlapped modes need rollout workers of their own (``rollout.workers``); their samples are corrected by ``algorithm.rollout_correction``."""
    max_staleness: int = 2
    """``async``: no sample is trained on by weights more than this many updates newer than the ones that generated it (``one_step_off`` is 1; ``sync`` 0). Logged per step as ``rollout/staleness_mean`` and ``_max``."""
    partial_rollout: Literal["continue", "requeue"] = "continue"
    """``async``: what a generation does when newer weights arrive while it runs. ``continue``: its next micro-batches use them (its sequences keep the versions they were sampled under); ``requeue``: the micro-batches made under older weights are dropped and generated again with the new ones, so all of a step's samples come from one version (fresher, at the cost of the dropped work)."""
    workers: int = 0
    """Rollout workers of their own: processes (Ray actors; in one process, a thread beside the trainer) that hold a copy of the policy and generate, their weights sent after every update. 0: the policy's ranks generate (colocated). ``rollout.mode`` other than ``sync`` needs at least 1 (set to 1 when left at 0)."""
    weight_transport: Literal["auto", "object_store", "collective"] = "auto"
    """How the trainer's weights reach rollout workers of their own (fitrl/distributed/weight_sync.py). ``object_store``: the policy's rank 0 gathers every full tensor to its host and the dict travels through Ray's object store to each worker. ``collective``: a process group of its own between rank 0 and the workers (NCCL on CUDA: each gathered tensor is broadcast from the device, ``weight_bucket_mb`` at a time; gloo on CPU); Ray runs only. ``auto``: ``collective`` for Ray runs on CUDA, else ``object_store``."""
    weight_bucket_mb: float = 256
    """``weight_transport=collective``: the size of one broadcast bucket in MiB, the memory the trainer's rank 0 and each worker hold on the device for a push beyond the weights themselves (a tensor larger than this is sent on its own)."""

    def __post_init__(self) -> None:
        check_sampling(self, "rollout", training=True)
        if self.max_response_length < 1 or self.micro_batch_size < 1:
            raise ConfigError("rollout.max_response_length and rollout.micro_batch_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_staleness < 1:
            raise ConfigError(f"rollout.max_staleness must be >= 1 (rollout.mode=sync trains on-policy), got "
                              f"{self.max_staleness}")
        if self.workers < 0:
            raise ConfigError(f"rollout.workers must be >= 0 (0: the policy's ranks generate), got {self.workers}")
        if not self.weight_bucket_mb * 2**20 >= 1024:
            raise ConfigError(f"rollout.weight_bucket_mb must be at least 1 KiB (MiB per broadcast bucket), got "
                              f"{self.weight_bucket_mb}")
        if not (math.isfinite(self.mismatch_stop_kl) and self.mismatch_stop_kl >= 0):
            raise ConfigError(f"rollout.mismatch_stop_kl must be a finite number >= 0 (0 disables), got "
                              f"{self.mismatch_stop_kl}")
        if not self.mismatch_stop_factor >= 1:
            raise ConfigError(f"rollout.mismatch_stop_factor must be >= 1 (times the recent median), got "
                              f"{self.mismatch_stop_factor}")
        if self.kv_cache_memory is not None:
            if parse_bytes(self.kv_cache_memory, "rollout.kv_cache_memory") <= 0:
                raise ConfigError("rollout.kv_cache_memory must be a positive size, e.g. 2GiB")

    def sleep_level_for(self, *, pushes: bool) -> tuple[int, str]:
        """The vLLM engine's sleep level (GPU) and why, as its log line says it: ``sleep_level``
        when set, else from what the engine does next. ``pushes``: the trainer pushes its weights
        after every update (a training run). The engine and the memory plan both ask here.

        >>> RolloutConfig().sleep_level_for(pushes=True)[0], RolloutConfig().sleep_level_for(pushes=False)[0]
        (2, 1)
        >>> RolloutConfig(sleep_level=1).sleep_level_for(pushes=True)
        (1, 'rollout.sleep_level=1')
        """
        if self.sleep_level != "auto":
            return self.sleep_level, f"rollout.sleep_level={self.sleep_level}"
        if pushes:
            return 2, ("rollout.sleep_level=auto: every update pushes the weights, which would overwrite a host "
                       "copy of them before the next rollout")
        return 1, "rollout.sleep_level=auto: no update pushes weights (trainer.val_only), so the host keeps them"

    @property
    def lead(self) -> int:
        """Steps the rollout workers may generate ahead of the update: 0 (``sync``), 1
        (``one_step_off``) or ``max_staleness`` (``async``)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    @property
    def capabilities(self) -> EngineCapabilities:
        """What ``engine`` declares it can do (fitrl/core/engines.py): what callers ask instead
        of its name."""
        return engine_capabilities(self.engine)

    @property
    def trainer_engine(self) -> str:
        """The engine the policy's own ranks run: ``engine``, or with rollout workers of their own
        (which then run ``engine``) whose engine holds its own copy of the weights,
        :data:`DEFAULT_ENGINE` on the trained module, for validation only (a second engine copy
        beside each trainer rank would cost memory for a few greedy passes)."""
        if not self.workers or not self.capabilities.holds_own_weights:
            return self.engine
        return DEFAULT_ENGINE

    def sampling(self) -> SamplingConfig:
        """Training-time sampling as the engines take it."""
        return SamplingConfig(**sampling_fields(self), max_tokens=self.max_response_length)

    def val_sampling(self) -> SamplingConfig:
        """Validation sampling, its length bounded by ``max_response_length`` unless set."""
        v = self.val
        return SamplingConfig(**sampling_fields(v), max_tokens=v.max_tokens or self.max_response_length)


def sampling_fields(s: Sampling) -> dict:
    """The :class:`Sampling` fields of ``s``, by name."""
    return {f.name: getattr(s, f.name) for f in fields(Sampling)}
