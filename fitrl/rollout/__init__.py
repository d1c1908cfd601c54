"""Rollout engines behind one interface (:mod:`fitrl.rollout.engine`), each with its memory planner
beside it (``<engine>_plan.py``, fitrl/memory/engines.py); importing the package registers the
built-in ones (``hf``, ``vllm``; vLLM itself is imported only when that engine is built). One line
per engine: docs/architecture.md, "Adding a rollout engine"."""

from fitrl.rollout import hf, hf_plan  # noqa: F401  (register the engine and its planner)
from fitrl.rollout import vllm_engine, vllm_plan  # noqa: F401
from fitrl.rollout.engine import ROLLOUT_ENGINES, RolloutEngine, build_engine

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "build_engine"]
