"""What a model loaded on the CPU keeps of its checkpoint file besides its parameters.

safetensors maps the checkpoint file (``MAP_PRIVATE``) and transformers' loaded parameters are
views of that mapping where the file holds them as the model does (same name, shape and dtype):
they are the parameters, counted once. A mixture of experts differs: Qwen3-MoE checkpoints hold
each expert's ``gate_proj``, ``up_proj`` and ``down_proj`` (the transformers 4 layout, which
transformers 5 still writes), and loading stacks them into new 3-D ``gate_up_proj`` and
``down_proj`` tensors. Reading them for the stack faults the per-expert pages into the mapping,
and the mapping lives on as long as any parameter is a view of it, the whole run when the model
is loaded plainly on the CPU: so the process's RSS holds the experts twice, the stacked copy
(anonymous memory) and the file's pages of them (clean file pages: the kernel may drop them
under memory pressure, but RSS, the guard and ``VmHWM`` count them until it does).

Measured (a /tmp script over bench/plan_accuracy.py, ``/proc/self/smaps`` of the safetensors
mapping; bench/RESULTS.md, "The memory plan of a mixture of experts"): the medium tiny MoE's
mapping held 0.906 GiB after loading (its experts: 0.902 GiB), the small one's 0.131 GiB (0.129),
and the small one's still held them after the update (the optimizer's writes turn the other
parameters' pages anonymous inside the same mapping); a second plain load in the same process
(the in-process reference) maps and faults them again.

Not held:

- where the model's dtype differs from the file's: every parameter is a cast copy, no view keeps
  the mapping, and it is unmapped after loading (a bf16 load of the fp32 tiny MoE: 0 bytes mapped);
- on CUDA (the CPU copy is dropped once the model is on its device) and under Ray (sharding copies
  each rank's shards; rank 0's source model is deleted after it fills them:
  fitrl/models/loading.py): the plan's ``load`` phase counts the checkpoint there.

The file's dtype is its ``config.json``'s ``torch_dtype`` / ``dtype``, bf16 when neither is set, as
the node's ``checkpoint pages`` (fitrl/memory/services.py).
"""

from __future__ import annotations

from typing import Any

from fitrl.memory.roles import _source_shape
from fitrl.memory.run import Run
from fitrl.memory.states import DTYPE_BYTES
from fitrl.models.shape import ModelShape

LABEL = "checkpoint pages (experts)"
"""The plan's component: the mapped file pages of the stacked experts of a role's model."""


def stacked_experts_mapped(run: Run, section: Any) -> int:
    """Bytes of the checkpoint file that stay resident beside the stacked experts of the model of
    the role configured by ``section`` (its ``model``, unset or without a path: the actor's, as the
    reference's and the critic's), in a process that loaded it plainly on the CPU; 0 otherwise (the module
    docstring), and for a dense model."""
    if run.cuda or run.distributed or section is None:
        return 0
    model = getattr(section, "model", None) or run.cfg.actor.model
    path = model.path or run.cfg.actor.model.path  # (a section may set only the dtype: ref.model.dtype)
    shape = run.shape if path == run.cfg.actor.model.path else _source_shape(path, "model.path")
    return _stacked_bytes(shape, model.dtype)


def _stacked_bytes(shape: ModelShape, dtype: str) -> int:
    params = getattr(shape.decoder, "stacked_expert_params", 0)  # (a dense decoder stacks nothing)
    on_disk = shape.raw.get("torch_dtype") or shape.raw.get("dtype")
    on_disk = on_disk if on_disk in DTYPE_BYTES else "bfloat16"
    return params * DTYPE_BYTES[dtype] if params and on_disk == dtype else 0
