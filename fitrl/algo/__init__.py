"""RL math: advantage estimators, policy losses, KL estimators. Pure tensor functions only:
nothing here imports a model, a worker or a config loader.

Importing the package registers every estimator, loss, aggregation and KL estimator, so the
registries below are complete wherever they are read (the config's name checks among them).
"""

from fitrl.algo import advantages, kl, losses  # noqa: F401  (registration)
from fitrl.algo.advantages import compute_advantages
from fitrl.algo.kl import KL_ESTIMATORS
from fitrl.algo.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from fitrl.algo.spec import ADVANTAGE_ESTIMATORS, AlgorithmSpec, algorithm_spec

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "AlgorithmSpec",
           "algorithm_spec", "compute_advantages"]
