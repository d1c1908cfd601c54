"""What each rollout engine can do, as the layers below the engines read it.

A rollout engine (fitrl/rollout/) declares its :class:`EngineCapabilities` beside itself, as the
``capabilities`` class attribute of its :class:`~fitrl.rollout.engine.RolloutEngine`; registering
it in ``ROLLOUT_ENGINES`` enters that declaration here under the engine's name. The config, the
memory model and the roles then ask this table what ``rollout.engine`` does (holds its own copy
of the weights, sleeps, shards over devices) instead of testing its name, and need neither torch
nor vLLM to ask: this module imports neither. The table is filled when :mod:`fitrl.rollout` is
imported, which the command line and the Python API do before a config loads (fitrl/cli.py,
fitrl/api.py), as for the check of the name itself (fitrl/core/registry.py, ``CHECKED_ON_LOAD``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitrl.core.errors import ConfigError
from fitrl.core.registry import Registry


@dataclass(frozen=True)
class EngineCapabilities:
    """What one engine does, in the terms its callers decide by. The defaults are an engine that
    generates with the trained module itself (the ``hf`` engine), as
    :class:`~fitrl.memory.engines.EnginePlanner`'s defaults plan one."""

    holds_own_weights: bool = False
    """It keeps a copy of the policy's weights of its own, which the trainer pushes after every
    update; False: it computes with the module it is given (a rollout worker then builds a whole
    model for it, fitrl/roles/rollout_worker.py; rollout workers running such an engine need no
    other engine on the trainer's ranks, ``RolloutConfig.trainer_engine``)."""
    sleeps: bool = False
    """On a GPU it gives its memory back between rollouts from a memory pool of its own
    (``rollout.sleep_level``; vLLM's pool refuses the allocator's expandable segments,
    fitrl/core/allocator.py ``cuda_alloc_env``)."""
    tensor_parallel: bool = False
    """It shards one engine over ``rollout.tensor_parallel_size`` devices, whose ranks must then
    generate in lockstep (one agent episode per rank cannot; a rollout worker runs one device so far).
    False: ``tensor_parallel_size`` does not apply to it."""
    records_routing: bool = False
    """It records the experts a mixture-of-experts policy's router chose for every sampled token
    (the batch's ``routed_experts``: fitrl/models/moe_routing.py), which ``actor.routing_replay``
    needs."""
    title: str = ""
    """Its name in prose ("vLLM"), for messages and the plan's notes; empty: the registered name."""

    def called(self, name: str) -> str:
        """``title``, else the registered ``name``.

        >>> EngineCapabilities(title="vLLM").called("vllm"), EngineCapabilities().called("dummy")
        ('vLLM', 'dummy')
        """
        return self.title or name


ENGINE_CAPABILITIES: Registry[EngineCapabilities] = Registry("rollout engine", "rollout.engine")
"""Each registered engine's declaration, under its ``rollout.engine`` name (filled by
``fitrl.rollout.engine.ROLLOUT_ENGINES``; nothing else adds to it)."""


def engine_capabilities(name: str) -> EngineCapabilities:
    """What the engine registered as ``name`` declares; a :class:`ConfigError` naming the
    registered engines when there is none of that name."""
    if not ENGINE_CAPABILITIES.names():
        raise ConfigError(f"rollout.engine={name}: no rollout engine is registered yet (importing fitrl.rollout "
                          "registers the built-in ones)")
    return ENGINE_CAPABILITIES.get(name)
