"""The interface every rollout engine implements, and the registry ``rollout.engine`` names.

A policy worker owns one engine beside its trained model. Per RL step the worker calls
``wake`` → ``generate`` (one or more times) → ``sleep`` around the rollout phase, and
``push_weights`` after each update so the next rollout samples from the new policy.

The Hugging Face engine shares the trained module, so pushing, sleeping and waking cost
nothing. An engine with its own copy of the weights (vLLM) streams them in ``push_weights``,
frees its KV cache (and weights, by level) in ``sleep`` and takes them back in ``wake``;
``release`` frees everything at the end of a run. See docs/architecture.md ("Adding a rollout
engine").

Each engine declares what it can do (:class:`~fitrl.core.engines.EngineCapabilities`, its
``capabilities`` class attribute), which registering it enters in the light table the config and
the memory model read (fitrl/core/engines.py); and it reports to the memory guard and the hang
watchdog through :data:`GENERATION` only, so that a long ``generate`` beats
(tests/test_engine_capabilities.py).

Layout of the batch ``generate`` returns, for B = prompts x n sequences, P = longest prompt,
R = longest response actually generated (<= ``sampling.max_tokens``):

  input_ids        (B, P+R)  prompt left-padded | response right-padded
  attention_mask   (B, P+R)  1 on real prompt tokens and on response tokens up to EOS
  position_ids     (B, P+R)  from the model family (real tokens counted, for text models);
                   (B, 3, P+R) for a multimodal rope (Qwen-VL: temporal, height, width)
  responses        (B, R)
  response_mask    (B, R)    1 up to and including the first EOS
  finished         (B,)      1 when the response emitted EOS (0: cut at max_tokens)
  rollout_logprobs (B, R)    log-prob of each sampled token at the sampling temperature
  routed_experts   (B, R, L, k) int16, a mixture of experts' only, from an engine that records
                   routing: each sampled token's experts on the L sparse layers (-1: none;
                   fitrl/models/moe_routing.py)
  fields: the prompts' per-prompt fields repeated n times (a vision-language prompt's
          ``multi_modal_inputs`` among them, shared, not copied), and ``response_text``
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Iterator, Optional, TypeVar

import torch

from fitrl.config.schema import RolloutConfig, SamplingConfig
from fitrl.core.engines import ENGINE_CAPABILITIES, EngineCapabilities
from fitrl.core.registry import Registry
from fitrl.data.batch import Batch
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.progress import PROGRESS

T = TypeVar("T")


class EngineRegistry(Registry):
    """The engines by name; adding one also enters the capabilities its class declares in
    :data:`~fitrl.core.engines.ENGINE_CAPABILITIES`, so the two never disagree."""

    def add(self, name: str, item) -> None:
        super().add(name, item)
        ENGINE_CAPABILITIES.add(name, item.capabilities)

    def remove(self, name: str) -> None:
        super().remove(name)
        ENGINE_CAPABILITIES.remove(name)


ROLLOUT_ENGINES: Registry = EngineRegistry("rollout engine", "rollout.engine", checked_on_load=True)


class GenerationHooks:
    """The one way a generation reports to the memory guard (fitrl/telemetry/guard.py) and the
    hang watchdog (fitrl/telemetry/progress.py, fitrl/trainer/watchdog.py): a generate that never
    beats is declared hung after ``trainer.hang_timeout_s``, and one that never reads the guard
    grows its KV cache until the OS kills the process. Every engine calls these (as
    :data:`GENERATION`) rather than the two singletons, so that what a generation owes both is
    written once."""

    @staticmethod
    def safe_point() -> None:
        """Between units of a generation where stopping loses only this phase's work: each
        micro-batch, or once before a library's ``generate`` takes over. A full guard reading,
        local: generation runs no collective, and ranks may reach different numbers of these."""
        GUARD.check(collective=False)

    @staticmethod
    def step(guard: bool = True) -> None:
        """Each decode step (or each finished request): a heartbeat and, with ``guard``, a
        time-limited guard reading (``GUARD.poll``: the KV cache grows token by token).
        ``guard=False`` inside a library's own loop, where raising would leave it half-way."""
        if guard:
            GUARD.poll()
        PROGRESS.beat()

    @classmethod
    def steps(cls, items: Iterable[T]) -> Iterator[T]:
        """``items`` (a loop's decode steps), each after :meth:`step`."""
        for item in items:
            cls.step()
            yield item


GENERATION = GenerationHooks()


@dataclass(frozen=True)
class EngineContext:
    """What an engine holding its own copy of the policy needs beyond the trained module (the
    ``hf`` engine needs none of it)."""

    model_path: str = ""
    """The directory the policy was loaded from: config, tokenizer and processor files (its
    weights are not read: the first push brings the trainer's)."""
    tokenizer_path: str = ""
    dtype: str = "float32"
    """The precision generation runs in (the policy's compute dtype)."""
    max_model_len: int = 0
    """Longest sequence a rollout can make: prompt plus response tokens."""
    seed: int = 0
    """This rank's seed for the engine's own initialisation."""
    weights: Optional[Callable[[], Iterator[tuple[str, torch.Tensor]]]] = None
    """The trainer's current weights under the checkpoint's names, one full tensor at a time
    (LoRA adapters merged); a collective under FSDP2, so every rank drains it together."""
    limit_images: int = 0
    """Images (and videos) per prompt at most (vision-language models)."""
    device: Optional[torch.device] = None
    """Where the engine runs, when the module it is given holds no weights (a rollout worker's
    ``meta`` module: fitrl/roles/rollout_worker.py); None: the module's own device."""
    pushes: bool = True
    """The trainer pushes its weights after every update (a training run), so that whatever the
    engine keeps of them while asleep is overwritten before it generates again; False: nothing
    is pushed after the first wake (``trainer.val_only``). ``rollout.sleep_level=auto`` reads it
    (:meth:`fitrl.config.rollout.RolloutConfig.sleep_level_for`)."""


class RolloutEngine(ABC):
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()
    """What the engine can do (fitrl/core/engines.py); the default is an engine that generates
    with the trained module. Each engine declares its own."""

    @classmethod
    @abstractmethod
    def from_config(cls, model: torch.nn.Module, tokenizer, cfg: RolloutConfig, *,
                    inputs: ModelInputs = TEXT_INPUTS, context: EngineContext = EngineContext()) -> "RolloutEngine":
        """The engine for the trained ``model`` on this rank. ``inputs`` is the model family's
        :class:`~fitrl.models.families.base.ModelInputs` for it: the positions of whole
        sequences and any extra inputs (images) of a batch. ``context``: what an engine with its
        own copy of the weights needs (:class:`EngineContext`)."""

    @abstractmethod
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        """Sample ``sampling.n`` responses per prompt (field ``prompt_ids``: list[list[int]])."""

    def push_weights(self) -> None:
        """Make the next ``generate`` use the trainer's current weights."""

    def sleep(self) -> None:
        """Between rollouts: give back the memory the engine holds for generation."""

    def wake(self) -> None:
        """Before a rollout: take back what ``sleep`` gave up."""

    def release(self) -> None:
        """End of the run: free everything the engine holds."""

    def metrics(self) -> dict[str, float]:
        """The engine's own figures of the last step (e.g. ``perf/weight_push_s``)."""
        return {}


def build_engine(cfg: RolloutConfig, model: torch.nn.Module, tokenizer, *,
                 inputs: ModelInputs = TEXT_INPUTS, context: EngineContext = EngineContext()) -> RolloutEngine:
    """The engine ``rollout.engine`` names (its module must have been imported: :mod:`fitrl.rollout`
    imports every built-in engine)."""
    return ROLLOUT_ENGINES.get(cfg.engine).from_config(model, tokenizer, cfg, inputs=inputs, context=context)
