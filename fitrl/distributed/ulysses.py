"""Ulysses sequence parallelism: one sequence split across the ranks of a group, attention heads
exchanged all-to-all (DeepSpeed-Ulysses's layout).

Every rank of a sequence-parallel group of size u holds the same packed micro-batch (rows, S)
(fitrl/core/packing.py, S a multiple of u) and runs its chunk of S / u consecutive positions
through the model: embeddings, norms, MLPs and the head are per token, so their activations are
1/u of the whole. Only attention needs every position; around it, an all-to-all turns each rank's
(rows, heads, S/u, d) queries, keys and values into (rows, heads/u, S, d): the whole sequence for
a slice of the heads. Attention runs there, plain causal (each row holds one sequence), and a
second all-to-all brings (rows, S, heads/u, d) back to (rows, S/u, heads, d). The per-rank activation
peak falls by about u; the exchanges carry 4 x (rows x S/u x hidden) values per layer each way.

Gradients: both exchanges are their own adjoints (an all-to-all of equal chunks), so autograd
differentiates through them; each rank's weight gradients are those of its chunk's tokens, and the
sum over the group is the whole sequence's (FSDP2 sums over every rank: fitrl/distributed/fsdp.py).
Per-token outputs come back to every rank of the group with :func:`gather_sequence`, whose
backward hands each rank its own positions' gradient.

The attention runs through transformers' attention interface under its own name
(:data:`ATTENTION`), set on the model's config only for the length of :func:`sequence_parallel`;
its mask function is a no-op (the model's mask would be built for the chunk; the whole row's is
plain causal).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from fitrl.distributed.heads import INNER

ATTENTION = "fitrl_ulysses"


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: ``size`` consecutive ranks holding the same
    micro-batches, this rank the ``rank``-th chunk of every packed row."""
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int


def sequence_groups(size: int) -> Optional[SequenceGroup]:
    """Split the default process group into groups of ``size`` consecutive ranks (every rank
    calls this, in the same order: ``new_group`` is collective); None when ``size`` is 1."""
    if size <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence-parallel size {size} does not divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = SequenceGroup(group, size, rank - start)
    return mine


@dataclass
class _Active:
    group: Optional[dist.ProcessGroup]
    size: int
    inner: str
    model: torch.nn.Module


_ACTIVE: Optional[_Active] = None


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 goes to rank i; chunk i received comes from rank i. Its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # before empty_like: it would copy a permuted view's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """(B, H, S/u, d) this rank's positions, every head -> (B, H/u, S, d) every position, this
    rank's heads."""
    B, H, s, d = x.shape
    chunks = x.reshape(B, u, H // u, s, d).permute(1, 0, 2, 3, 4)  # (u, B, H/u, s, d): heads for rank i
    got = _AllToAll.apply(chunks, group)  # (u, B, H/u, s, d): rank i's positions
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // u, u * s, d)


def heads_to_seq(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """(B, S, H/u, d) every position, this rank's heads -> (B, S/u, H, d)."""
    B, S, h, d = x.shape
    chunks = x.reshape(B, u, S // u, h, d).permute(1, 0, 2, 3, 4)  # (u, B, s, H/u, d): positions of rank i
    got = _AllToAll.apply(chunks, group)  # (u, B, s, H/u, d): rank i's heads
    return got.permute(1, 2, 0, 3, 4).reshape(B, S // u, u * h, d)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], **kwargs):
    """transformers' attention signature: query (B, Hq, S/u, d), key/value (B, Hkv, S/u, d) ->
    ((B, S/u, Hq, d), None). The model's ``attention_mask`` (built for the chunk) is not used."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    active = _ACTIVE
    if active is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside fitrl.distributed.ulysses.sequence_parallel")
    g, u = active.group, active.size
    q, k, v = (seq_to_heads(t, g, u) for t in (query, key, value))
    mask = None  # SDPA: its causal flag
    if active.inner == "eager":  # eager has no causal flag: an additive mask says it
        S = q.shape[2]
        mask = torch.full((S, S), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)[None, None]
    kwargs.pop("is_causal", None)
    out, _ = ALL_ATTENTION_FUNCTIONS[active.inner](module, q, k, v, mask, is_causal=mask is None, **kwargs)
    return heads_to_seq(out, g, u), None


def _no_mask(*args, **kwargs):
    return None  # the chunk's mask would never be read: the whole row's attention is plain causal


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


@contextlib.contextmanager
def sequence_parallel(model: torch.nn.Module, group, size: int) -> Iterator[None]:
    """While inside, ``model``'s attention layers exchange heads over ``group`` (``size`` ranks)
    and attend plain causal over the whole rows: every row holds one sequence (then filler, which
    attends to the sequence before it; nothing reads the filler's outputs), so no (rows, S, S)
    mask is needed. Held over a pass's forwards *and* backwards (fitrl/roles/actor.py): a layer
    that gradient checkpointing recomputes in backward must exchange heads again. Re-entering
    for the same model is a no-op; generation and other passes outside it run the model's own
    attention."""
    global _ACTIVE
    if _ACTIVE is not None:
        if _ACTIVE.model is model:
            yield
            return
        raise RuntimeError("sequence_parallel is already active for another model")
    config = model.config
    inner = config._attn_implementation
    if inner not in INNER:
        raise ValueError(f"sequence parallelism wraps sdpa or eager attention, not {inner!r}")
    _register()
    _ACTIVE = _Active(group, size, inner, model)
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = inner
        _ACTIVE = None


def over_pass(model: torch.nn.Module, group: Optional[SequenceGroup]):
    """:func:`sequence_parallel` for a role's pass with this rank's group, or nothing without one."""
    return sequence_parallel(model, group.group, group.size) if group is not None else contextlib.nullcontext()


class _GatherSequence(torch.autograd.Function):
    """Forward: the sum over the group of per-rank tensors, each zero outside its rank's positions
    (so the sum is the whole). Backward: the gradient as it is: every rank computes the same loss
    from the whole, so each rank's positions receive exactly their gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def sum_gradients(model: torch.nn.Module, group) -> None:
    """Sum each gradient over the group: for a model not sharded by FSDP2 (whose reduce-scatter
    already sums over every rank), each rank holds only its chunk's share."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
