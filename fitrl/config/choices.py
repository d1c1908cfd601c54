"""Every registry-backed name in a config, checked when the config loads.

Estimators, policy losses, loss aggregations, KL estimators, built-in reward functions and trackers
live in registries next to their code (:mod:`fitrl.algo`, :mod:`fitrl.rewards`,
:mod:`fitrl.tracking`); a misspelt name fails
here with the valid choices, before a run directory exists or a model loads (``fitrl train``,
``fitrl plan`` and ``fitrl config`` alike). Registries that live above this layer (the rollout
engines) are checked through :data:`fitrl.core.registry.CHECKED_ON_LOAD` once their package is
imported, which the command line does before loading.

Importing this module imports the registries and so torch (~2 s): the loader imports it only once
the config's keys and types are valid, so structural mistakes still answer at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fitrl.agents.env import check_agent_spec
from fitrl.algo import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, AlgorithmSpec, algorithm_spec
from fitrl.core.errors import ConfigError
from fitrl.core.registry import CHECKED_ON_LOAD
from fitrl.distributed.sharding import SHARDING_BACKENDS
from fitrl.rewards.functions import check_reward_spec
from fitrl.tracking import TRACKERS

if TYPE_CHECKING:
    from fitrl.config.schema import FitrlConfig


def check_choices(cfg: "FitrlConfig") -> None:
    """Raise ConfigError on the first registry-backed name that is not registered."""
    a = cfg.algorithm
    # (pure distillation, weight 1, trains on the teacher's signal alone: one sample per prompt is enough)
    if algorithm_needs(cfg).groups and cfg.rollout.n < 2 and a.distill.weight < 1.0:
        raise ConfigError(f"algorithm.adv_estimator={a.adv_estimator} compares the samples of each prompt, but "
                          f"rollout.n={cfg.rollout.n}: every advantage would be 0 and nothing would train; set "
                          f"rollout.n to 2 or more (GRPO commonly uses 4-16), or use an estimator without groups "
                          f"(reinforce_plus_plus, remax, gae)")
    POLICY_LOSSES.check(a.policy_loss)
    LOSS_AGGREGATIONS.check(a.loss_agg_mode)
    LOSS_AGGREGATIONS.check(cfg.critic.loss_agg_mode, "critic.loss_agg_mode")
    KL_ESTIMATORS.check(a.kl_estimator)
    KL_ESTIMATORS.check(a.kl_in_reward.estimator, "algorithm.kl_in_reward.estimator")
    if a.distill.agg_mode is not None:
        LOSS_AGGREGATIONS.check(a.distill.agg_mode, "algorithm.distill.agg_mode")
    check_reward_spec(cfg.reward.function)
    check_agent_spec(cfg.rollout.agent.env, cfg.rollout.agent.tools)
    for name in cfg.trainer.loggers:
        TRACKERS.check(name)  # whether its package is installed is checked when training starts
    if SHARDING_BACKENDS.names():  # (registered once fitrl.sharding is imported: the command line does first)
        for key, section in sharded_sections(cfg):
            SHARDING_BACKENDS.check(section.sharding, f"{key}.sharding")
    for registry in CHECKED_ON_LOAD:
        section, key = registry.config_key.split(".")
        registry.check(getattr(getattr(cfg, section), key))


def sharded_sections(cfg: "FitrlConfig") -> list[tuple[str, object]]:
    """``(key, section)`` of every config section that names a sharding backend (the roles and
    the model reward sources), whether or not this run builds it."""
    found = [("actor", cfg.actor), ("ref", cfg.ref), ("critic", cfg.critic), ("teacher", cfg.teacher)]
    return found + [(f"reward.sources.{name}", src) for name, src in cfg.reward.sources.items()]


def algorithm_needs(cfg: "FitrlConfig") -> AlgorithmSpec:
    """Which roles and extra rollouts this run's algorithm needs (critic, greedy baseline,
    reference): the one declaration the role builder, the collector and the planner read."""
    a = cfg.algorithm
    return algorithm_spec(a.adv_estimator, kl_loss=a.use_kl_loss, kl_in_reward=a.kl_in_reward.enable)
