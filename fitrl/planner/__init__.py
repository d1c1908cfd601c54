"""Memory you can see before the run: the planner behind ``fitrl plan`` and ``fitrl train``'s pre-flight check.

``plan_config(cfg, Hardware.for_config(cfg))`` returns a :class:`Plan`: per process kind and
phase, device and host memory by component, and the verdict; :func:`fitrl.planner.recommend.recommend`
ranks changes by speed cost with their predicted effect. The planner reads the resolved config,
its ``plan:`` section included (:mod:`fitrl.config.plan`). It composes the memory model
(:mod:`fitrl.memory`) and the planners the rollout engines register beside themselves
(fitrl/rollout/). See docs/architecture.md, "Memory model". Importing this package does not
import torch (``fitrl --help`` imports it through :mod:`.cli`).
"""

from fitrl.memory.model import PHASES, Hardware, Plan
from fitrl.models.shape import ModelShape
from fitrl.planner.plan import plan_config

__all__ = ["PHASES", "Hardware", "Plan", "plan_config", "ModelShape"]
