"""Which processes a run starts, derived once from its config (:func:`run_layout`).

The run builder (fitrl/trainer/run.py, ``_train_once`` and ``check_gpu_count``) builds exactly the
worker groups a :class:`RunLayout` lists, and the memory planner (fitrl/memory/run.py,
``Run.layout``; every ``RolePlanner.built`` in fitrl/memory/roles.py) plans exactly those: the two
cannot disagree about whether, say, a validation-only run starts its rollout workers (it does not).

A role here is a name of fitrl/roles/workers.py ``ROLES`` and of fitrl/memory/roles.py
``ROLE_PLANNERS``; a new role gets its line in :data:`ROLE_LINES`, which says when a run builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

if TYPE_CHECKING:
    from fitrl.config.schema import FitrlConfig

Mode = Literal["rl", "supervised", "validation"]
"""``rl``: ``fitrl train``; ``supervised``: ``fitrl sft`` (fitrl/trainer/sft.py); ``validation``:
``trainer.val_only`` (validation alone, no step)."""


@dataclass(frozen=True)
class Role:
    """One role the run builds."""
    name: str
    """Its name in ``ROLES`` and ``ROLE_PLANNERS``."""
    group: str
    """Its worker group's name (Ray actors are named after it)."""
    model: str
    """The role whose model computes it: its own ``name`` (a model and group of its own), or the
    one standing in (LoRA's reference is the policy with its adapters off: ``actor``)."""
    colocated: bool = True
    """Under Ray on the policy's bundles, rank by rank (False: devices of its own)."""

    @property
    def own_model(self) -> bool:
        return self.model == self.name


@dataclass(frozen=True)
class RolloutWorkers:
    """Rollout workers of their own (``rollout.workers``, fitrl/roles/rollout_worker.py)."""
    count: int
    engine: str
    """The engine they generate with (``rollout.engine``)."""
    mode: str
    """``rollout.mode``: how their generation overlaps the update."""


@dataclass(frozen=True)
class RunLayout:
    """The processes and roles a run starts; built by :func:`run_layout`, never by hand."""
    mode: Mode
    roles: tuple[Role, ...]
    """In build order: the policy first (the others colocate on its bundles), the rollout workers last."""
    rollout: Optional[RolloutWorkers]
    """None: the policy's ranks generate (or nothing is generated for training)."""
    reward: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Reward source names by kind (``function``, ``model``, ``judge``, ``environment``);
    ``reward.function`` alone, without ``reward.sources``, is the function source ``""``."""
    backend: str = "inprocess"
    nnodes: int = 1
    devices_per_node: int = 1
    """The policy's ranks per node (1 in one process)."""
    device: Optional[str] = None
    """``cpu`` or ``cuda`` as ``trainer.device`` says; None for ``auto`` (the machine decides)."""

    @property
    def world_size(self) -> int:
        """The policy's ranks (and each colocated role's)."""
        return self.nnodes * self.devices_per_node

    @property
    def devices(self) -> int:
        """Devices the run takes, one per rank: the policy's world and its rollout workers'."""
        return self.world_size + (self.rollout.count if self.rollout else 0)

    def role(self, name: str) -> Optional[Role]:
        return next((r for r in self.roles if r.name == name), None)

    def builds(self, name: str) -> bool:
        """Whether ``name`` gets a worker group (a model) of its own."""
        r = self.role(name)
        return r is not None and r.own_model


def run_layout(cfg: "FitrlConfig", supervised: bool = False) -> RunLayout:
    """The layout of ``cfg``; ``supervised``: a ``fitrl sft`` run (its config already passed
    through fitrl/trainer/sft.py ``supervised_config``)."""
    t, r = cfg.trainer, cfg.rollout
    mode: Mode = "supervised" if supervised else "validation" if t.val_only else "rl"
    reward = _reward_sources(cfg)
    rollout = RolloutWorkers(r.workers, r.engine, r.mode) if r.workers and mode == "rl" else None
    ray = t.backend == "ray"
    return RunLayout(mode=mode, roles=_roles(cfg, mode, reward, rollout), rollout=rollout, reward=reward,
                     backend=t.backend, nnodes=t.nnodes if ray else 1,
                     devices_per_node=t.devices_per_node if ray else 1,
                     device=t.device if t.device != "auto" else None)


@dataclass(frozen=True)
class _Facts:
    """What decides which roles a run builds."""
    cfg: "FitrlConfig"
    mode: Mode
    needs: Any
    """The algorithm's roles (fitrl/config/choices.py, ``algorithm_needs``)."""
    reward: dict[str, tuple[str, ...]]
    rollout: Optional[RolloutWorkers]

    @property
    def trains(self) -> bool:
        """A supervised step has no KL term and no value model (fitrl/trainer/sft.py)."""
        return self.mode != "supervised"


@dataclass(frozen=True)
class RoleLine:
    """When a run builds a role, and how (its :class:`Role`)."""
    built: Callable[[_Facts], bool]
    group: Optional[str] = None
    """Its worker group's name; None: the role's."""
    stands_in: Callable[[_Facts], Optional[str]] = lambda facts: None
    """The role whose model computes it instead of a model of its own, or None."""
    colocated: bool = True


ROLE_LINES: dict[str, RoleLine] = {
    "actor": RoleLine(lambda f: True, group="policy"),
    # with LoRA the policy's frozen base is the reference: no second model
    "ref": RoleLine(lambda f: f.trains and f.needs.reference,
                    stands_in=lambda f: "actor" if f.cfg.actor.lora.enabled else None),
    "teacher": RoleLine(lambda f: f.mode == "rl" and f.cfg.algorithm.distill.enabled),  # frozen, scoring the rollouts
    "critic": RoleLine(lambda f: f.trains and f.needs.critic),
    # validation scores by the reward in every mode, so the reward's models are built in every mode
    "reward_model": RoleLine(lambda f: "model" in f.reward),
    "judge": RoleLine(lambda f: "judge" in f.reward),
    # generation for training only: validation runs on the policy's ranks
    "rollout": RoleLine(lambda f: f.rollout is not None, colocated=False),
}
"""Every role a run can build, in build order (the policy first: the others colocate on its
bundles; the rollout workers last). A role of ``ROLES`` without a line here would never be built:
fitrl/trainer/complete.py (``missing_counterparts``) names it."""


def _roles(cfg: "FitrlConfig", mode: Mode, reward: dict, rollout: Optional[RolloutWorkers]) -> tuple[Role, ...]:
    # lazy: fitrl.config.choices imports fitrl.algo and so torch, which loading a config must not wait for
    from fitrl.config.choices import algorithm_needs

    facts = _Facts(cfg, mode, algorithm_needs(cfg), reward, rollout)
    return tuple(Role(name, line.group or name, line.stands_in(facts) or name, line.colocated)
                 for name, line in ROLE_LINES.items() if line.built(facts))


def _reward_sources(cfg: "FitrlConfig") -> dict[str, tuple[str, ...]]:
    """Source names by kind, as fitrl/roles/reward_sources.py ``RewardSources`` scores them."""
    by_kind: dict[str, tuple[str, ...]] = {}
    for name, src in cfg.reward.sources.items():
        by_kind[src.kind] = by_kind.get(src.kind, ()) + (name,)
    if not cfg.reward.sources:
        by_kind["function"] = ("",)
    agent = cfg.rollout.agent
    if agent.enabled and agent.reward in ("environment", "sum"):  # the episode's rewards from its environment
        by_kind["environment"] = ("env",)
    return by_kind
