"""Log-probabilities and entropy of sampled tokens, computed in chunks of tokens.

Logits are often the true memory peak (docs/architecture.md, "Memory model"). One fp32 ``tokens x vocab`` copy at
T=4,096 and V=152,064 is 2.3 GiB; a naive ``log_softmax`` + gather + entropy holds about four
(logits, log-probs, probs, their product: 9.3 GiB measured) and with backward about five
(11.6 GiB). ``response_logprobs`` never builds the full logits: the lm_head receives the
(B, R+1, H) last hidden states and each chunk of ``chunk_size`` tokens goes through its weight,
the temperature, logsumexp, gather and entropy in fp32 for that chunk only. The peak is two
``chunk x vocab`` fp32 copies whatever T: 1.2 GiB at chunk 1,024 (7.9x below naive at T=4,096),
and in backward the same plus the lm_head's weight gradient (1.7 GiB at hidden 896, 6.8x below).
Figures from ``bench/logprob_memory.py`` on CPU.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch.nn import functional as F

from fitrl.core.packing import PackedLayout, pack_layout, packed_size
from fitrl.core.padding import model_positions, trim_padding
from fitrl.distributed.collectives import all_ranks_agree
from fitrl.distributed.sharding import sharded_over_ranks
from fitrl.distributed.ulysses import SequenceGroup
from fitrl.ops.packed import can_pack, packed_forward
from fitrl.ops.shared_prompt import PromptGroups, can_share, find_prompt_groups, shared_prompt_forward
from fitrl.ops.token_origin import ORIGINS


def _stats(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, entropy_grad: bool):
    """logits (N, V) fp32, already divided by the temperature -> logp (N,), entropy (N,) or None,
    logsumexp (N,).

    Without a graph, two (N, V) copies at most: the logits and one temporary (logsumexp's, then
    softmax's, multiplied in place).
    """
    log_norm = torch.logsumexp(logits, dim=-1)  # (N,)
    logp = logits.gather(-1, labels[:, None]).squeeze(-1) - log_norm
    if not with_entropy:
        return logp, None, log_norm
    # A logged metric needs no graph; as an entropy bonus it keeps the chunk's softmax for backward.
    if entropy_grad and torch.is_grad_enabled():
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        return logp, log_norm - (probs * logits).sum(-1), log_norm  # H = logsumexp(z) - sum(p * z)
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        return logp, log_norm - probs.mul_(logits).sum(-1), log_norm


def _chunk_logits(hidden, weight, bias, temperature):
    """(n, H) -> (n, V) fp32 logits / temperature: the lm_head matmul in the model's dtype, as HF's forward."""
    logits = F.linear(hidden, weight, bias).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class HeadGrads:
    """A linear head's input, weight and bias gradients, accumulated chunk by chunk from each
    chunk's fp32 ``dL/dz`` (n, V): what every chunked head's backward shares (this module's, and
    the top-k heads' of fitrl/roles/topk_heads.py). The weight's is summed in its own dtype, as
    autograd would sum per-chunk gradients."""

    def __init__(self, ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        self.need_h, self.need_w, self.need_b = ctx.needs_input_grad[:3]
        self.weight, self.bias = weight, bias
        self.h = torch.empty_like(hidden) if self.need_h else None
        self.w = torch.zeros_like(weight) if self.need_w else None
        self.b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if self.need_b else None

    def add(self, grad: torch.Tensor, h: torch.Tensor, start: int, temperature: float) -> None:
        """``grad``: dL/dz of the chunk of hidden states ``h`` starting at row ``start`` (divided
        in place by the temperature: dL/dlogits)."""
        if temperature != 1.0:
            grad.div_(temperature)
        if self.need_b:
            self.b += grad.sum(0)
        grad = grad.to(self.weight.dtype)
        if self.need_h:
            self.h[start:start + h.shape[0]] = grad @ self.weight
        if self.need_w:
            self.w.addmm_(grad.T, h)

    def result(self) -> tuple:
        return self.h, self.w, self.b.to(self.bias.dtype) if self.need_b else None


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """logp and entropy of N tokens from hidden states, chunk by chunk, forward and backward.

    Saved: the (N, H) hidden states and (N,) statistics, and when one chunk holds all N tokens
    its (N, V) fp32 logits. Autograd through a chunk wrapped in ``torch.utils.checkpoint`` saves
    as little, but its backward holds ~5 (chunk, V) fp32 tensors (logits, softmax, the gradients
    of softmax, logsumexp, gather and the entropy product): 3.5 GiB at chunk 1,024, only 3.3x
    below naive. Here backward recomputes each chunk's logits (or takes the kept ones) and forms
    dL/dlogits in place, with z = logits / temperature, p = softmax(z), y the label:
        dlogp/dz = onehot(y) - p        dH/dz = -p * (log p + H)
        dL/dz = g_logp * onehot(y) - p * (g_logp + g_H * (log p + H))
    two (chunk, V) fp32 tensors at most (1.2 GiB). Keeping a single chunk does not raise that
    peak: the head's backward is the first of the backward pass, so the kept logits and their
    gradient are the two. It saves the recompute's matmul: a third of the head's work, which
    dominates a small model with a large vocabulary (and bf16 on a CPU without bf16 units).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy, entropy_grad):
        logps, entropies, norms = [], [], []
        # the logits for backward when one chunk holds all N (none without a graph: a log-prob
        # pass keeps nothing). With more chunks a kept one would stay alive beside a recomputed
        # one and its gradient (ctx holds it until backward returns): three chunks.
        keep = hidden.shape[0] <= chunk_size and any(ctx.needs_input_grad[:3])
        kept = hidden.new_empty(0, dtype=torch.float32)
        for i in range(0, max(hidden.shape[0], 1), chunk_size):  # one empty chunk when N = 0
            logits = _chunk_logits(hidden[i:i + chunk_size], weight, bias, temperature)
            logp, entropy, log_norm = _stats(logits, labels[i:i + chunk_size], with_entropy, False)
            logps.append(logp)
            entropies.append(entropy if with_entropy else logp.new_empty(0))
            norms.append(log_norm)
            if keep:
                kept = logits
            del logits  # before the next chunk's are built
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(norms), entropy, kept)
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad = temperature, chunk_size, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, labels, log_norm, entropy, kept = ctx.saved_tensors
        t, c = ctx.temperature, ctx.chunk_size
        grads = HeadGrads(ctx, hidden, weight, bias)
        for i in range(0, hidden.shape[0], c):
            h, gl = hidden[i:i + c], g_logp[i:i + c, None]
            # the kept chunk is consumed in place (once_differentiable: there is one backward)
            logits = kept if kept.numel() else _chunk_logits(h, weight, bias, t)
            logp = logits.sub_(log_norm[i:i + c, None])  # (n, V) log p
            del logits
            grad = logp.exp()  # (n, V) p
            if ctx.entropy_grad:  # p * (g_logp + g_H * (log p + H))
                grad.mul_(logp.add_(entropy[i:i + c, None]).mul_(g_entropy[i:i + c, None]).add_(gl))
            else:
                grad.mul_(gl)
            del logp
            grad.neg_().scatter_add_(-1, labels[i:i + c, None], gl)  # dL/dz (n, V)
            grads.add(grad, h, i, t)
            del grad  # else the last chunk's gradient lives on while the next chunk's logits are built
        return (*grads.result(), None, None, None, None, None)


def head_logprobs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """hidden (..., H), labels (...) long, lm_head weight (V, H) and bias (V,) -> logp (...) fp32
    and entropy (...) fp32 or None, as ``token_logprobs(F.linear(hidden, weight, bias), labels)``
    but with at most ``chunk_size x V`` logits alive, in forward and in backward."""
    shape = labels.shape
    kind = "cpu" if hidden.device.type == "meta" else hidden.device.type  # meta: the planner's trace, no autocast
    if torch.is_autocast_enabled(kind):
        # Under autocast the head's matmul runs in its dtype. The backward below recomputes the
        # chunks' logits outside any autocast context, so the cast happens here, once, as a
        # differentiable op: the gradient reaches the fp32 weight through it, as autocast's would.
        low = torch.get_autocast_dtype(kind)
        hidden, weight = hidden.to(low), weight.to(low)
        bias = bias.to(low) if bias is not None else None
    with torch.autocast(kind, enabled=False):
        logp, entropy = _ChunkedHeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                                   labels.reshape(-1), temperature, chunk_size, with_entropy,
                                                   entropy_grad)
    return logp.view(shape), entropy.view(shape) if with_entropy else None


def linear_head(model: torch.nn.Module) -> torch.nn.Module:
    """The module HF's forward calls as the output head (tied or not), which the chunked passes
    replace for a call; a model whose logits are more than that linear map is refused."""
    for name in ("final_logit_softcapping", "logit_scale"):  # Gemma-2, Cohere: more than a linear head
        if getattr(model.config, name, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(model).__name__} has {name}; chunked log-probs assume a linear lm_head")
    return model.get_output_embeddings()


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    model_kwargs: Optional[dict] = None,
    share_prompts: bool = False,
    pack: bool = False,
    sequence_group: Optional[SequenceGroup] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the last ``response_length`` tokens of each row under ``model``.

    input_ids (B, P+R): left-padded prompt then right-padded response; position_ids (B, P+R),
    or (B, k, P+R) for a multimodal rope. ``model_kwargs``: further forward inputs (a
    vision-language model's pixel values and grids). Returns (B, R) tensors.
    No (B, R, V) logits are ever materialised: for the length of this call the lm_head's forward
    is ``head_logprobs``, so the whole computation runs inside the model's own forward. FSDP2
    then gathers the head's weight for it whichever unit owns it and whether or not the root
    reshards after forward (as it does after ``set_reshard_after_forward(True)``), and its
    pre-backward hook, attached to the forward's output, gathers it again before backward.
    (Running ``model.model`` and then the head outside the forward fails on a root-sharded
    model: "got mixed torch.Tensor and DTensor".)

    ``share_prompts``: rows with the same prompt run it through the model once
    (:mod:`fitrl.ops.shared_prompt`); ``pack``: the rows' real tokens run packed end to end, with
    no padding (:mod:`fitrl.ops.packed`). Each where the model allows it, and where it runs fewer
    positions than the padded forward (:func:`choose_layout`). ``sequence_group``: Ulysses
    sequence parallelism over that group (fitrl/distributed/ulysses.py), always packed; every
    rank of the group passes the same micro-batch and gets the whole result.
    """
    head = linear_head(model)
    full_length = response_length
    origin = ORIGINS.columns(attention_mask, position_ids, response_length)  # for layer hooks (a MoE's routers)
    # columns that are padding in every row cost compute and activation memory for nothing
    input_ids, attention_mask, position_ids, response_length = trim_padding(
        input_ids, attention_mask, position_ids, response_length)
    labels = input_ids[:, -response_length:]  # (B, R')

    def chunked_head(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., 2)
        logp, entropy = head_logprobs(hidden, labels, head.weight, head.bias,
                                      temperature=temperature, chunk_size=chunk_size,
                                      with_entropy=with_entropy, entropy_grad=entropy_grad)
        return torch.stack([logp, entropy if with_entropy else torch.zeros_like(logp)], dim=-1)

    if sequence_group is not None:
        if not can_pack(model, position_ids, model_kwargs):
            raise ValueError(f"sequence parallelism needs a packed forward, which {type(model).__name__} with these "
                             "inputs cannot run (images, a multimodal rope or sliding-window attention)")
        # one sequence per row: causal attention over each whole row, no (rows, S, S) mask (fitrl/distributed/ulysses.py)
        layout = pack_layout(attention_mask, multiple=sequence_group.size, one_per_row=True)
    else:
        layout = choose_layout(model, input_ids, attention_mask, position_ids, response_length, model_kwargs,
                               share_prompts=share_prompts, pack=pack)
    ORIGINS.feed_layout(origin, layout, response_length)  # where each token of the calls below comes from
    if isinstance(layout, PackedLayout):
        out = packed_forward(model, head, chunked_head, input_ids, position_ids, response_length, layout,
                             sequence_group=sequence_group)
    elif isinstance(layout, PromptGroups):
        layout.record_skipped(attention_mask, input_ids.shape[1] - response_length)
        out = shared_prompt_forward(model, head, lambda hidden: chunked_head(hidden, labels), input_ids,
                                    attention_mask, position_ids, response_length, layout)  # (B, R, 2)
    else:  # position t predicting t + 1: (B, R + 1, H) -> (B, R, 2)
        head.forward = lambda hidden: chunked_head(hidden[:, :-1], labels)  # shadows nn.Linear.forward
        try:
            out = model(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=model_positions(position_ids), use_cache=False,
                        logits_to_keep=response_length + 1, **(model_kwargs or {})).logits  # (B, R, 2)
        finally:
            del head.forward
    out = torch.nn.functional.pad(out, (0, 0, 0, full_length - response_length))  # back to (B, R, 2)
    entropy = out[..., 1] if entropy_grad else out[..., 1].detach()
    return out[..., 0], entropy if with_entropy else None


def choose_layout(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor, response_length: int, model_kwargs: Optional[dict], *,
                  share_prompts: bool, pack: bool) -> Union[PackedLayout, PromptGroups, None]:
    """The forward that runs the fewest positions through the model for this (trimmed) micro-batch:
    packed (rows x W), shared prompts (distinct prompts x P + B x R) or padded (B x (P+R), None),
    among those allowed. A tie keeps the simpler: padded, then shared."""
    B, T = input_ids.shape
    P = T - response_length
    best, cost = None, B * T
    groups, shared, wins = None, cost, False
    if share_prompts and can_share(model, position_ids, model_kwargs):
        groups = find_prompt_groups(input_ids, attention_mask, P)
        shared = groups.rows.numel() * P + B * response_length
        wins = groups.shared and shared < cost
    if share_prompts and sharded_over_ranks(model):
        # the shared-prompt forward runs the model twice, and under FSDP2 every run of a layer
        # all-gathers its weights: ranks running different layouts would pair mismatched
        # collectives (a hang, or silently exchanged shards), so they share only all together
        wins = all_ranks_agree(wins, input_ids.device)
    if wins:
        best, cost = groups, shared
    if pack and can_pack(model, position_ids, model_kwargs):
        if packed_size(attention_mask.sum(-1).tolist()) < cost:  # (the layout's tensors only when it wins)
            best = pack_layout(attention_mask)
    return best


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits (..., V) any float dtype, labels (...) long -> logp (...) fp32 and entropy (...) fp32 or None.

    For callers that already hold logits; only the fp32 copy is chunked. Entropy is computed
    without autograd unless ``entropy_grad`` (an entropy bonus in the loss).
    """
    if logits.dim() == 2:
        logits, labels = logits[None], labels[None]
        squeeze = True
    else:
        squeeze = False
    if logits.dim() != 3:
        raise ValueError(f"expected logits (B, T, V) or (T, V), got {tuple(logits.shape)}")
    logps, entropies = [], []
    # Chunks are views (row blocks, or pieces of one row when a row is longer than a chunk), so
    # a non-contiguous input such as ``logits[:, :-1]`` is never copied whole; only the fp32
    # chunk is materialised.
    for chunk, chunk_labels in _chunks(logits, labels, chunk_size):
        rows, t = chunk_labels.shape
        chunk = chunk.float()
        if temperature != 1.0:
            chunk = chunk / temperature
        logp, entropy, _ = _stats(chunk.reshape(rows * t, -1), chunk_labels.reshape(-1), with_entropy, entropy_grad)
        logps.append(logp.view(rows, t))
        entropies.append(entropy.view(rows, t) if with_entropy else None)
    logp = _join(logps, labels.shape)
    entropy = _join(entropies, labels.shape) if with_entropy else None
    if squeeze:
        logp = logp[0]
        entropy = entropy[0] if entropy is not None else None
    return logp, entropy


def _chunks(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int):
    """Yield (rows, T, V) blocks of about ``chunk_size`` tokens, or (1, t, V) pieces of long rows."""
    B, T, _ = logits.shape
    if T <= chunk_size:
        rows = max(1, chunk_size // max(T, 1))
        for b in range(0, B, rows):
            yield logits[b:b + rows], labels[b:b + rows]
    else:
        for b in range(B):
            for t in range(0, T, chunk_size):
                yield logits[b:b + 1, t:t + chunk_size], labels[b:b + 1, t:t + chunk_size]


def _join(parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Reassemble chunk results (in _chunks order) into (B, T)."""
    B, T = shape
    if not parts:
        return torch.zeros(shape)
    if parts[0].shape[1] == T:  # row blocks
        return torch.cat(parts, dim=0)
    per_row = (T + parts[0].shape[1] - 1) // parts[0].shape[1]
    return torch.cat([torch.cat(parts[b * per_row:(b + 1) * per_row], dim=1) for b in range(B)], dim=0)

