"""A padding-free forward: the micro-batch's sequences packed end to end (``actor.packing``).

The padded forward of :func:`fitrl.ops.logprob.response_logprobs` runs (B, P+R) positions, most
of them padding when lengths vary (one 4,000-token sequence among 200-token ones pads every row
to 4,000). Here the real tokens run as (rows, W) (:mod:`fitrl.core.packing`), attention kept
within each sequence by the model's own packed-sequence handling (positions restarting at 0 and
no attention mask: transformers' masks for SDPA and eager attention, ``cu_seqlens`` for
flash-attention varlen), and the head reads only the hidden states that predict a real response
token. Every token sees the keys and values it sees padded, so log-probs, entropies and gradients
agree to rounding (tests/test_packing.py).

Not for: vision-language inputs (images and a multimodal rope's (k, B, T) positions) and
sliding-window attention. :func:`can_pack` says which.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from fitrl.core.packing import PackedLayout, packed_positions
from fitrl.distributed.ulysses import ATTENTION as ULYSSES_ATTENTION, SequenceGroup, gather_sequence, sequence_parallel
from fitrl.ops.sharing import full_attention
from fitrl.ops.varlen import VARLEN

# attention implementations that read packed positions as sequence boundaries (and Ulysses's, set
# for the length of a sequence-parallel pass: its rows hold one sequence each; and the varlen
# kernel's, set for a pass on CUDA: fitrl/ops/varlen.py)
PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", ULYSSES_ATTENTION, VARLEN)


def can_pack(model: torch.nn.Module, position_ids: torch.Tensor, model_kwargs: Optional[dict]) -> bool:
    """Can :func:`packed_forward` run this model's forward (see the module docstring)?"""
    if model_kwargs or position_ids.dim() != 2:  # images, multimodal rope
        return False
    config = model.config
    if getattr(config, "_attn_implementation", "sdpa") not in PACKED_ATTENTION:
        return False
    return full_attention(vars(config))  # the attributes config.json's keys became


def packed_forward(model: torch.nn.Module, head: torch.nn.Module,
                   head_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], input_ids: torch.Tensor,
                   position_ids: torch.Tensor, response_length: int, layout: PackedLayout,
                   causal_lm: bool = True, sequence_group: Optional[SequenceGroup] = None) -> torch.Tensor:
    """The model's output over the responses, (B, R, k), from one packed forward.

    ``head`` is the model's output module (the lm_head, or a critic's score head); for the call it
    is ``head_fn(hidden (K, H), labels (K,)) -> (K, k)`` on the K hidden states that predict a real
    response token and those tokens; padding response positions come back as zeros.
    input_ids and position_ids (B, P+R) as the padded forward has them (padding trimmed).
    ``causal_lm``: the model takes ``logits_to_keep`` (a token-classification critic does not).
    ``sequence_group``: this rank runs its chunk of every row, attention exchanging heads over the
    group (fitrl/distributed/ulysses.py; the layout's width a multiple of the group's size), and
    the per-token outputs of the whole group come back to every rank.
    """
    B, T = input_ids.shape
    R = response_length
    real = layout.target[:, T - R:] >= 0  # (B, R) real response tokens
    keep = layout.target[:, T - R - 1:T - 1][real]  # (K,) the packed slot predicting each
    labels = input_ids[:, T - R:][real]  # (K,)

    ids, pos = layout.gather(input_ids), packed_positions(layout, position_ids)  # (rows, W)
    context = contextlib.nullcontext()
    mine = None
    if sequence_group is not None:  # this rank's chunk [lo, lo + w) of every row
        W = ids.shape[1]
        w = W // sequence_group.size
        lo = sequence_group.rank * w
        col = keep % W
        mine = (col >= lo) & (col < lo + w)  # (K,) the response tokens this rank predicts
        if not layout.single:
            raise ValueError("a Ulysses forward needs one sequence per row (pack_layout(one_per_row=True))")
        context = sequence_parallel(model, sequence_group.group, sequence_group.size)  # a no-op inside the pass's
        ids, pos = ids[:, lo:lo + w], pos[:, lo:lo + w]
        keep, labels = ((keep // W) * w + col - lo)[mine], labels[mine]

    def response_head(hidden: torch.Tensor) -> torch.Tensor:  # (rows, W, H) -> (K, k)
        return head_fn(hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep), labels)

    # The output is the head's (K, k), not a stand-in: FSDP2's root attaches its pre-backward hook
    # (which gathers the root's weights again) to the forward's output tensors.
    head.forward = response_head  # an instance attribute shadows the module's forward
    kwargs = {"logits_to_keep": 0} if causal_lm else {}  # 0: every position reaches the head
    try:
        with context:
            per_token = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                              **kwargs).logits  # (K, k)
    finally:
        del head.forward
    if mine is not None:  # every rank's tokens, each where it belongs
        whole = per_token.new_zeros((mine.numel(), per_token.shape[-1])).index_put((mine,), per_token)
        per_token = gather_sequence(whole, sequence_group.group)
    full = per_token.new_zeros((B, R, per_token.shape[-1]))
    return full.index_put((real,), per_token)
