"""Memory you can see before the run: ``fitrl plan`` (DESIGN §4, issue 5 part 1).

``plan_config(cfg, Hardware(...), PlanInputs(...))`` returns a :class:`Plan`: per process kind
and phase, device and host memory by component, the verdict, and (``recommend``) changes
ranked by speed cost with their predicted effect. Model states and KV cache are closed forms
(:mod:`.states`, :mod:`.shapes`); activations and logits come from tracing the real log-prob
code under FakeTensorMode (:mod:`.trace`); every other constant is in :mod:`.calibration`.
Importing this package does not import torch.
"""

from fitrl.memory.cli import add_plan_command
from fitrl.memory.inputs import Hardware, Images, PlanInputs, RolloutEngine, load_plan_config, plan_inputs_from_dict
from fitrl.memory.plan import PHASES, Plan, plan_config
from fitrl.memory.shapes import ModelShape

__all__ = ["add_plan_command", "Hardware", "Images", "PlanInputs", "RolloutEngine", "load_plan_config",
           "plan_inputs_from_dict", "PHASES", "Plan", "plan_config", "ModelShape"]
