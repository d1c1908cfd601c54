"""Memory you can see before the run: the planner behind ``fitrl plan`` and ``fitrl train``'s pre-flight check.

``plan_config(cfg, Hardware.for_config(cfg))`` returns a :class:`Plan`: per process kind and
phase, device and host memory by component, and the verdict; :func:`fitrl.memory.recommend.recommend`
ranks changes by speed cost with their predicted effect. The planner reads the resolved config,
its ``plan:`` section included (:mod:`fitrl.config.plan`). Model states and KV cache are closed
forms (:mod:`.states`, :mod:`.shapes`); activations and logits come from tracing the real
log-prob code on the meta device (:mod:`.trace`); every other constant is in
:mod:`.calibration`. See docs/architecture.md, "Memory model". Importing this package does not
import torch (``fitrl --help`` imports it through :mod:`.cli`).
"""

from fitrl.memory.model import PHASES, Hardware, Plan
from fitrl.memory.plan import plan_config
from fitrl.memory.shapes import ModelShape

__all__ = ["PHASES", "Hardware", "Plan", "plan_config", "ModelShape"]
