"""What an algorithm needs beyond the policy, declared once where each estimator is registered.

``@estimator("gae", critic=True)`` registers an advantage estimator and what it needs; the
role builder (which roles to start), the rollout collector (whether to draw a greedy baseline)
and the memory planner (which models to count) all read :func:`algorithm_spec`, never the
estimator's name or signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from fitrl.core.registry import Registry

F = TypeVar("F", bound=Callable)

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "algorithm.adv_estimator")


@dataclass(frozen=True)
class EstimatorNeeds:
    critic: bool = False
    """Per-token values from a critic model (GAE)."""
    baseline: bool = False
    """A greedy response per prompt, scored by the reward (ReMax's baseline rollout)."""
    groups: bool = False
    """A baseline from the other samples of the same prompt: ``rollout.n`` of 1 leaves every
    advantage 0 (nothing to compare against), so such a run is refused."""


_NEEDS: dict[str, EstimatorNeeds] = {}


def estimator(name: str, *, critic: bool = False, baseline: bool = False, groups: bool = False) -> Callable[[F], F]:
    """Register an advantage estimator under ``name`` with what it needs from other roles (and
    whether it compares the samples of a prompt)."""
    def wrap(fn: F) -> F:
        ADVANTAGE_ESTIMATORS.add(name, fn)
        _NEEDS[name] = EstimatorNeeds(critic=critic, baseline=baseline, groups=groups)
        return fn
    return wrap


@dataclass(frozen=True)
class AlgorithmSpec:
    """The roles and extra rollouts one configured algorithm needs."""

    critic: bool
    """A value model is built and trained (``critic.*``)."""
    baseline: bool
    """Each step also generates one greedy response per prompt and scores it."""
    reference: bool
    """A frozen reference model is built (some KL term needs its log-probs)."""
    groups: bool = False
    """The advantages compare the samples of a prompt: ``rollout.n`` must be at least 2."""


def algorithm_spec(adv_estimator: str, *, kl_loss: bool, kl_in_reward: bool) -> AlgorithmSpec:
    """The spec of a run; raises ConfigError naming the valid estimators on an unknown one."""
    ADVANTAGE_ESTIMATORS.check(adv_estimator)
    needs = _NEEDS[adv_estimator]
    return AlgorithmSpec(critic=needs.critic, baseline=needs.baseline, reference=kl_loss or kl_in_reward,
                         groups=needs.groups)
