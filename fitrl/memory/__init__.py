"""The memory model: what one process holds, per phase, on the device and the host.

A run's derived numbers (:mod:`.run`), its roles' states (:mod:`.states`: closed forms), its
model's shapes (:mod:`.shapes`), the traced transients of its forward and backward passes
(:mod:`.trace`: the real log-prob code on the meta device), a trainer rank's phases
(:mod:`.trainer`), the driver's and a node's (:mod:`.services`), and the interface every rollout
engine's planner implements (:mod:`.engines`; the planners live beside their engines, in
fitrl/rollout/). Every other constant is in :mod:`.calibration`. :mod:`fitrl.planner` composes
these into a plan with its verdict and recommendations. See docs/architecture.md, "Memory
model". Importing this package does not import torch.
"""

from fitrl.memory.model import PHASES, Hardware, Plan
from fitrl.models.shape import ModelShape

__all__ = ["PHASES", "Hardware", "Plan", "ModelShape"]
