"""Building a role's model on one rank: loading, FSDP2 sharding, and moving between phases.

Without a process group (the in-process backend) a model is simply loaded. Under
``torch.distributed`` (the Ray backend) the order is fixed, as in torchtitan:

  1. every rank builds the architecture on the ``meta`` device (no memory);
     with ``init=rank0`` only rank 0 also reads the checkpoint (one full copy on the host);
     with ``init=every_rank`` every rank reads it (one full copy per rank: the slow path of
     DESIGN §1 story 5, kept as an option);
  2. gradient checkpointing is switched on (it wraps layers, so before sharding);
  3. ``fully_shard`` each decoder layer, then the root, on a 1-D mesh (full shard) or a 2-D
     (replicate, shard) mesh (hybrid: shard within a node, replicate across nodes);
  4. meta ranks allocate their shards (``to_empty``) and rank 0 broadcasts the weights into
     them (``set_model_state_dict(..., broadcast_from_rank0=True)``); buffers that are not in
     the state dict (rotary ``inv_freq``) are broadcast too.

Losses use global token counts (all-reduced), so gradients are *summed* across ranks:
FSDP's default division by the world size is switched off (``set_gradient_divide_factor(1)``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fitrl.config.schema import FSDPConfig, ModelConfig
from fitrl.models.loading import DTYPES, check_model_dir


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _causal_lm_builders(model: ModelConfig):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(dtype=DTYPES[model.dtype], attn_implementation=model.attn_implementation)

    def from_pretrained() -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, **kwargs)

    def from_config() -> nn.Module:
        config = AutoConfig.from_pretrained(model.path, local_files_only=True)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    return from_pretrained, from_config


def _value_model_builders(model: ModelConfig):
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model.path, num_labels=1, local_files_only=True)
    # From a causal-LM checkpoint the backbone loads and the one-output ``score`` head starts
    # random; dropout off so values are deterministic functions of the weights.
    config.classifier_dropout = 0.0
    kwargs = dict(dtype=DTYPES[model.dtype], attn_implementation=model.attn_implementation)

    def from_pretrained() -> nn.Module:
        # the new ``score`` head is expected to be missing from a causal-LM checkpoint: do not
        # print transformers' "newly initialized" report for it
        report = logging.getLogger("transformers.modeling_utils")
        drop = _DropLoadReport()
        report.addFilter(drop)
        try:
            return AutoModelForTokenClassification.from_pretrained(model.path, config=config, local_files_only=True,
                                                                   **kwargs)
        finally:
            report.removeFilter(drop)

    def from_config() -> nn.Module:
        return AutoModelForTokenClassification.from_config(config, **kwargs)
    return from_pretrained, from_config


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


BUILDERS: dict[str, Callable] = {"causal_lm": _causal_lm_builders, "value": _value_model_builders}


def build_model(kind: str, model: ModelConfig, fsdp: FSDPConfig, device: torch.device, *,
                what: str = "actor.model.path", nnodes: int = 1) -> nn.Module:
    """The role's model on this rank: plain when there is no process group, FSDP2-sharded otherwise."""
    check_model_dir(model.path, what)
    from_pretrained, from_config = BUILDERS[kind](model)
    if not distributed():
        m = from_pretrained().to(device)
        _enable_checkpointing(m, model)
        return m

    rank0_init = fsdp.init == "rank0"
    full_state, source = None, None
    if rank0_init:
        with torch.device("meta"):
            m = from_config()
        if dist.get_rank() == 0:
            source = from_pretrained()  # the one full copy, on the host
            full_state = source.state_dict()
    else:
        m = from_pretrained()
    _enable_checkpointing(m, model)
    shard(m, fsdp, device, nnodes=nnodes)
    if rank0_init:
        m.to_empty(device=device)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(m, full_state if full_state is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        _broadcast_buffers(m, source, device)
        del full_state, source
    return m


def _enable_checkpointing(m: nn.Module, model: ModelConfig) -> None:
    if model.gradient_checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False


def _broadcast_buffers(m: nn.Module, source: nn.Module | None, device: torch.device) -> None:
    """Buffers are replicated, not sharded, and some are not in the state dict (rotary
    ``inv_freq``): rank 0 copies them from the loaded model, then broadcasts them."""
    src = dict(source.named_buffers()) if source is not None else {}
    for name, buf in m.named_buffers():
        if name in src:
            buf.copy_(src[name].to(device))
        dist.broadcast(buf, src=0)


def decoder_layers(m: nn.Module) -> list[nn.Module]:
    """The transformer blocks (each becomes one FSDP unit)."""
    base = getattr(m, m.base_model_prefix, m) if hasattr(m, "base_model_prefix") else m
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers in {type(m).__name__}: FSDP needs one unit per layer")
    return list(layers)


def shard(m: nn.Module, fsdp: FSDPConfig, device: torch.device, *, nnodes: int = 1) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    world = dist.get_world_size()
    if fsdp.strategy == "hybrid" and nnodes > 1:
        mesh = init_device_mesh(device.type, (nnodes, world // nnodes), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fsdp.mixed_precision
          else MixedPrecisionPolicy())
    # pin_memory needs an accelerator: on a CPU-only machine CPUOffloadPolicy(pin_memory=True) fails
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    for layer in decoder_layers(m):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(m, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in fsdp_modules(m):
        module.set_gradient_divide_factor(1.0)
        # plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling
        module.set_force_sum_reduction_for_comms(True)


def fsdp_modules(m: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [x for x in m.modules() if isinstance(x, FSDPModule)]


@contextmanager
def gathered_for_generation(m: nn.Module) -> Iterator[None]:
    """Full parameters for the length of a ``generate`` call, released afterwards.

    Ranks generate different numbers of tokens; with per-layer all-gathers in every forward
    they would have to step in lockstep. Gathering once up front lets each rank decode on its
    own, at the cost of one full copy of the weights during generation.
    """
    modules = fsdp_modules(m)
    if not modules:
        yield
        return
    for x in modules:
        x.set_reshard_after_forward(False, recurse=False)
        x.unshard()
    try:
        yield
    finally:
        for x in modules:
            x.reshard()
            x.set_reshard_after_forward(True, recurse=False)


def all_reduce_sum(value: float, device: torch.device) -> float:
    """Sum a Python number over all ranks (identity without a process group)."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of a Python int over all ranks (identity without a process group)."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def move_model(m: nn.Module, device: torch.device | str) -> None:
    """Move parameters (sharded or not) and their gradients between host and device."""
    m.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device, non_blocking=True)


def full_state_dict(m: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the host (rank 0 gets it; collective on every rank)."""
    if not distributed():
        return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
