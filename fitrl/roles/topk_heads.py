"""The passes of on-policy distillation that need more than one label per token
(docs/algorithms.md, "On-policy distillation").

The teacher keeps, per response position, its log-prob of the sampled token and its ``k`` likeliest
tokens' log-probs and ids (:func:`teacher_token_stats`); the student, for the top-k forward KL,
needs its own log-probs at those ids with a gradient (:func:`student_topk_logprobs`). Both run as
:func:`fitrl.ops.logprob.response_logprobs` does: the lm_head's forward is replaced for the call,
so no (B, R, V) logits exist and FSDP2 gathers the head's weight inside the model's forward; the
same layouts (padded, shared prompts, packed: :func:`fitrl.ops.logprob.choose_layout`) and
chunks of ``chunk_size`` tokens. What differs is the head: :func:`head_forward` feeds it, with the
labels, one row of per-token extras (the teacher's ids) aligned with the tokens it sees.

Memory: the teacher's head holds one (chunk, V) fp32 logits block and its logsumexp temporary,
and returns (tokens, 1 + 2k) fp32 (ids as floats: exact below 2**24). The student's top-k head
(:class:`_ChunkedHeadTopk`) saves only the (N, H) hidden states the log-prob head saves too, the
(N, k) ids and (N,) logsumexps, recomputing each chunk's logits in backward as
``_ChunkedHeadLogprobs`` does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn import functional as F

from fitrl.core.packing import PackedLayout
from fitrl.core.padding import model_positions, trim_padding
from fitrl.ops.logprob import HeadGrads, choose_layout, head_logprobs, linear_head
from fitrl.ops.packed import packed_forward
from fitrl.ops.shared_prompt import PromptGroups, shared_prompt_forward
from fitrl.ops.token_origin import ORIGINS

MAX_FLOAT_ID = 2 ** 24
"""Token ids travel in the head's fp32 output; every integer below this is exact in fp32."""

HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""hidden (N, H), labels (N,), extras (N, ...) -> (N, k)."""


def head_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, response_length: int, head_fn: HeadFn, extras: torch.Tensor, *,
                 model_kwargs: Optional[dict] = None, share_prompts: bool = False, pack: bool = False) -> torch.Tensor:
    """The model's head replaced by ``head_fn`` over the responses: (B, R, k), zeros where a
    response position is padding. ``extras`` (B, R, ...) reach ``head_fn`` row for row with the
    tokens it scores, whichever layout runs (padding trimmed, as response_logprobs trims it)."""
    head = linear_head(model)
    full = response_length
    origin = ORIGINS.columns(attention_mask, position_ids, response_length)  # for layer hooks (a MoE's routers)
    input_ids, attention_mask, position_ids, response_length = trim_padding(
        input_ids, attention_mask, position_ids, response_length)
    R = response_length
    labels, extras = input_ids[:, -R:], extras[:, :R]  # (B, R'), (B, R', ...)

    def on_grid(hidden: torch.Tensor) -> torch.Tensor:  # (B, R', H) -> (B, R', k)
        flat = head_fn(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), extras.reshape(-1, *extras.shape[2:]))
        # not a view: FSDP2 hooks its pre-backward gather on the forward's output, which an in-place
        # op on a view would drop (it warns); the copy is (B, R', k), a few values per token
        return flat.view(*labels.shape, flat.shape[-1]).clone()

    layout = choose_layout(model, input_ids, attention_mask, position_ids, R, model_kwargs,
                           share_prompts=share_prompts, pack=pack)
    ORIGINS.feed_layout(origin, layout, R)  # where each token of the calls below comes from
    if isinstance(layout, PackedLayout):
        real = layout.target[:, input_ids.shape[1] - R:] >= 0  # (B, R'): the tokens packed_forward scores, in order
        mine = extras[real]
        out = packed_forward(model, head, lambda hidden, lab: head_fn(hidden, lab, mine), input_ids, position_ids,
                             R, layout)
    elif isinstance(layout, PromptGroups):
        layout.record_skipped(attention_mask, input_ids.shape[1] - R)
        out = shared_prompt_forward(model, head, on_grid, input_ids, attention_mask, position_ids, R, layout)
    else:  # position t predicting t + 1: (B, R' + 1, H) -> (B, R', k)
        head.forward = lambda hidden: on_grid(hidden[:, :-1])  # shadows nn.Linear.forward
        try:
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=model_positions(position_ids),
                        use_cache=False, logits_to_keep=R + 1, **(model_kwargs or {})).logits
        finally:
            del head.forward
    return F.pad(out, (0, 0, 0, full - R))  # back to (B, R, k)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], temperature: float):
    """(n, H) -> (n, V) fp32 logits / temperature (the head's matmul in the model's dtype)."""
    logits = F.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


# --------------------------------------------------------------------------------------- teacher


@torch.no_grad()
def teacher_token_stats(model: torch.nn.Module, micro, *, top_k: int, vocab: int, temperature: float,
                        chunk_size: int, model_kwargs: Optional[dict] = None, share_prompts: bool = False,
                        pack: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's log-prob of each sampled response token (B, R), and its ``top_k`` likeliest
    tokens' log-probs (B, R, k) fp32 and ids (B, R, k) long among the first ``vocab`` ids (the
    student's), all normalised over the teacher's whole vocabulary."""
    if vocab > MAX_FLOAT_ID:
        raise ValueError(f"a vocabulary of {vocab} ids does not travel exactly in fp32 (at most {MAX_FLOAT_ID})")
    head = model.get_output_embeddings()
    k = top_k

    def stats(hidden: torch.Tensor, labels: torch.Tensor, _unused: torch.Tensor) -> torch.Tensor:  # -> (N, 1 + 2k)
        out = hidden.new_empty((hidden.shape[0], 1 + 2 * k), dtype=torch.float32)
        for i in range(0, hidden.shape[0], chunk_size):
            logits = _logits(hidden[i:i + chunk_size], head.weight, head.bias, temperature)  # (n, V)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (n, 1)
            out[i:i + chunk_size, :1] = logits.gather(-1, labels[i:i + chunk_size, None]) - lse
            values, ids = logits[:, :vocab].topk(k, dim=-1)  # (n, k)
            out[i:i + chunk_size, 1:1 + k] = values - lse
            out[i:i + chunk_size, 1 + k:] = ids.float()
            del logits  # before the next chunk's are built
        return out

    responses = micro["responses"]
    out = head_forward(model, micro["input_ids"], micro["attention_mask"], micro["position_ids"], responses.shape[1],
                       stats, responses.new_zeros(responses.shape), model_kwargs=model_kwargs,
                       share_prompts=share_prompts, pack=pack)  # (B, R, 1 + 2k)
    return out[..., 0], out[..., 1:1 + k].contiguous(), out[..., 1 + k:].long()


# --------------------------------------------------------------------------------------- student


class _ChunkedHeadTopk(torch.autograd.Function):
    """Log-probs of N tokens at k given ids each, from hidden states, chunk by chunk.

    Forward: ``z[ids] - logsumexp(z)`` per chunk, z = logits / temperature. Saved: hidden (N, H),
    ids (N, k), the (N,) logsumexps. Backward recomputes each chunk's logits; with p = softmax(z)
    and g (N, k) the incoming gradient, ``dL/dz = scatter(g at ids) - p * sum_k g``: one (chunk, V)
    fp32 block and its gradient at a time, as fitrl/ops/logprob.py's ``_ChunkedHeadLogprobs``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_size):
        outs, norms = [], []
        for i in range(0, max(hidden.shape[0], 1), chunk_size):
            logits = _logits(hidden[i:i + chunk_size], weight, bias, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            outs.append(logits.gather(-1, ids[i:i + chunk_size]) - lse[:, None])
            norms.append(lse)
            del logits
        ctx.save_for_backward(hidden, weight, bias, ids, torch.cat(norms))
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return torch.cat(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        hidden, weight, bias, ids, lse = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        grads = HeadGrads(ctx, hidden, weight, bias)
        for i in range(0, hidden.shape[0], c):
            h, gc = hidden[i:i + c], g[i:i + c].float()
            grad = _logits(h, weight, bias, t).sub_(lse[i:i + c, None]).exp_()  # (n, V) p
            grad.mul_(gc.sum(-1, keepdim=True)).neg_().scatter_add_(-1, ids[i:i + c], gc)  # dL/dz
            grads.add(grad, h, i, t)
            del grad
        return (*grads.result(), None, None, None, None)


def head_topk_logprobs(hidden: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, *, temperature: float = 1.0,
                       chunk_size: int = 1024) -> torch.Tensor:
    """hidden (N, H), ids (N, k) long -> (N, k) fp32 log-probs at ``ids``, differentiable, with
    at most ``chunk_size x V`` logits alive (as :func:`fitrl.ops.logprob.head_logprobs`)."""
    kind = "cpu" if hidden.device.type == "meta" else hidden.device.type
    if torch.is_autocast_enabled(kind):  # (cast once, as a differentiable op: backward runs outside autocast)
        low = torch.get_autocast_dtype(kind)
        hidden, weight = hidden.to(low), weight.to(low)
        bias = bias.to(low) if bias is not None else None
    with torch.autocast(kind, enabled=False):
        return _ChunkedHeadTopk.apply(hidden, weight, bias, ids, temperature, chunk_size)


def student_topk_logprobs(model: torch.nn.Module, micro, ids: torch.Tensor, *, temperature: float, chunk_size: int,
                          entropy_grad: bool = False, model_kwargs: Optional[dict] = None,
                          share_prompts: bool = False, pack: bool = False):
    """One forward of the student: its log-probs (B, R) and entropies (B, R) of the sampled
    tokens (as the actor's pass), and its log-probs (B, R, k) at the teacher's ``ids`` (B, R, k),
    all with a graph (the entropy's only with ``entropy_grad``)."""
    head = model.get_output_embeddings()

    def both(hidden: torch.Tensor, labels: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # -> (N, 2 + k)
        logp, entropy = head_logprobs(hidden, labels, head.weight, head.bias, temperature=temperature,
                                      chunk_size=chunk_size, with_entropy=True, entropy_grad=entropy_grad)
        topk = head_topk_logprobs(hidden, at, head.weight, head.bias, temperature=temperature, chunk_size=chunk_size)
        return torch.cat([logp[:, None], entropy[:, None], topk], dim=-1)

    out = head_forward(model, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                       micro["responses"].shape[1], both, ids, model_kwargs=model_kwargs,
                       share_prompts=share_prompts, pack=pack)  # (B, R, 2 + k)
    entropy = out[..., 1] if entropy_grad else out[..., 1].detach()
    return out[..., 0], entropy, out[..., 2:]
