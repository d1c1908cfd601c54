"""What each model-holding role costs: its memory planner, registered under the role's name
beside the role's workers (``fitrl.roles.ROLES``), as an engine's planner is beside its engine.

A role's planner says whether a run builds the role, the states each of its ranks holds (weights,
gradients, optimizer, sharded as its ``fsdp`` section says), the phases in which it computes (its
weights on the device when ``offload_params`` moves them out between phases), the passes whose
traced transients are its process's (:mod:`.trainer`), and whether under Ray it is a worker group
of its own (a process per device, colocated rank by rank on the policy's bundles). The phase
modules read these through :func:`fitrl.memory.run.role_states`, ``process_roles`` and
``resident``: nothing in ``fitrl/memory/`` branches on a role's name besides this module.
``fitrl/trainer/complete.py`` checks that every role has its planner and every planner its role.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from fitrl.core.registry import Registry
from fitrl.memory.model import ACTOR_PHASES
from fitrl.memory.states import States, frozen_states, lora_states, trained_states

if TYPE_CHECKING:
    from fitrl.memory.run import Run


class RolePlanner(ABC):
    """The memory of one role's ranks."""

    name: str = ""
    title: str = ""
    """How the plan's table names the role's process of its own (under Ray)."""
    own_process: bool = True
    """Under Ray a worker group of its own (the policy's is the trainer rank itself)."""

    @abstractmethod
    def built(self, run: Run) -> bool:
        """Whether the run builds this role (the algorithm needs it, LoRA does not stand in for it)."""

    @abstractmethod
    def states(self, run: Run) -> tuple[States, Any]:
        """Per-rank states of the role and its ``fsdp`` config section."""

    @abstractmethod
    def active_phases(self, run: Run) -> set[str]:
        """The phases in which the role computes: its weights are on the device then."""

    def passes(self, run: Run) -> set[str]:
        """The phases whose traced log-prob or update transients its process holds (:mod:`.trainer`)."""
        return set()


ROLE_PLANNERS: Registry[RolePlanner] = Registry("role memory planner", "")
"""The plan lists the roles' states (and processes) in registration order: policy, reference, critic."""


class PolicyPlanner(RolePlanner):
    """The policy (actor): trained (or LoRA adapters on a frozen base) in every run, in the
    trainer rank itself."""
    name, title, own_process = "actor", "trainer rank", False

    def built(self, run: Run) -> bool:
        return True

    def states(self, run: Run) -> tuple[States, Any]:
        cfg, a = run.cfg, run.cfg.actor.fsdp
        n = run.shard_world(a.strategy)
        pinned = run.cuda and a.cpu_offload and run.fsdp
        if run.lora:  # the frozen base and the adapters; the adapters alone have gradients and AdamW states
            return lora_states(run.shape, run.lora.rank, run.lora_targets, n, cfg.actor.model.dtype, pinned), a
        return trained_states(run.shape, n, cfg.actor.model.dtype, pinned=pinned,
                              frozen_vision=cfg.actor.model.freeze_vision_tower), a

    def active_phases(self, run: Run) -> set[str]:
        return ACTOR_PHASES | ({"ref_logprob"} if run.lora else set())  # LoRA: the policy computes the reference

    def passes(self, run: Run) -> set[str]:
        return {"old_logprob", "update"} | ({"ref_logprob"} if run.lora else set())


class ReferencePlanner(RolePlanner):
    """The frozen reference model for the KL term; with LoRA the policy with its adapters off
    stands in for it (no model of its own)."""
    name, title = "ref", "reference rank (Ray actor)"

    def built(self, run: Run) -> bool:
        return run.spec.reference and not run.lora

    def states(self, run: Run) -> tuple[States, Any]:
        cfg, r = run.cfg, run.cfg.ref.fsdp
        dtype = (cfg.ref.model or cfg.actor.model).dtype
        return frozen_states(run.ref_shape or run.shape, run.shard_world(r.strategy), dtype,
                             pinned=run.cuda and r.cpu_offload and run.fsdp), r

    def active_phases(self, run: Run) -> set[str]:
        return {"ref_logprob"}

    def passes(self, run: Run) -> set[str]:
        return {"ref_logprob"}


class CriticPlanner(RolePlanner):
    """The value model of PPO: fp32 weights and AdamW states; its value and update passes have no
    traced transients (:mod:`.trainer`)."""
    name, title = "critic", "critic rank (Ray actor)"

    def built(self, run: Run) -> bool:
        return run.spec.critic

    def states(self, run: Run) -> tuple[States, Any]:
        c = run.cfg.critic.fsdp
        return trained_states(run.shape, run.shard_world(c.strategy), "float32",
                              pinned=run.cuda and c.cpu_offload and run.fsdp), c

    def active_phases(self, run: Run) -> set[str]:
        return {"old_logprob", "update"}


for _planner in (PolicyPlanner(), ReferencePlanner(), CriticPlanner()):
    ROLE_PLANNERS.add(_planner.name, _planner)
