"""Rollout engines behind one interface (:mod:`fitrl.rollout.engine`); importing the package
registers the built-in ones (``hf``, ``vllm``; vLLM itself is imported only when that engine is built)."""

from fitrl.rollout import hf, vllm_engine  # noqa: F401  (register the engines)
from fitrl.rollout.engine import ROLLOUT_ENGINES, RolloutEngine, build_engine

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "build_engine"]
