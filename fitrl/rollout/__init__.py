"""Rollout engines behind one interface (:mod:`fitrl.rollout.engine`); importing the package
registers the built-in ones (``hf``)."""

from fitrl.rollout import hf  # noqa: F401  (registers the engine)
from fitrl.rollout.engine import ROLLOUT_ENGINES, RolloutEngine, build_engine

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "build_engine"]
