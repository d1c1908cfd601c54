"""On-policy distillation losses: the student samples, a teacher scores the student's own tokens
(docs/algorithms.md, "On-policy distillation"). Pure tensor functions, like fitrl/algo/losses.py:
nothing here loads a model or reads
a config; the caller passes tensors, an aggregation mode and the mini-batch :class:`Denominators`.

Two signals, both at the states ``s_t = (prompt, y_<t)`` the student visited, ``pi`` the student
and ``nu`` the teacher:

* **Reverse KL on the sampled tokens** (policy-gradient OPD). Only ``log nu(y_t)`` at the sampled
  token is needed. ``k1_t = log pi(y_t) - log nu(y_t)`` is a one-sample estimate of
  ``KL(pi || nu)`` at ``s_t``; ``-k1_t`` is used as a per-token advantage, held fixed (stop
  gradient), times the policy gradient ``grad log pi(y_t)``. :func:`reverse_kl_pg_loss` is that
  update on-policy; :func:`reverse_kl_advantages` feeds any loss of ``POLICY_LOSSES``
  (fitrl/algo/losses.py) when the update is off-policy (several mini-batches, old log-probs).
* **Top-k forward KL** ``KL(nu || pi)`` on the teacher's top-k tokens plus one bucket for the rest
  of the vocabulary (:func:`topk_forward_kl`), differentiated directly through the student's
  log-probs at the teacher's ids. It needs the teacher's top-k log-probs and ids per token.

:func:`mix_distill_loss` mixes either with the RL policy loss: ``(1 - w) * rl + w * distill``.

Shapes: (B, T) per-token tensors and masks; (B, T, K) top-k tensors; (B, T, V) full logits.
Padded positions may hold anything, even ``-inf`` (a teacher that scored no token there): they are
replaced before any arithmetic, so neither the value nor the gradient sees them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fitrl.algo.losses import Denominators, aggregate, masked_mean

# ----------------------------------------------------------------------------------------- checks


def check_topk(k: int, vocab_size: int) -> None:
    """Raise ValueError unless ``1 <= k <= vocab_size`` (the config layer can call it before a run)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top-k must be a positive integer, got {k!r}")
    if k > vocab_size:
        raise ValueError(f"top-k {k} is larger than the vocabulary ({vocab_size} tokens); set k <= {vocab_size}")


def check_distill_weight(weight: float) -> None:
    """Raise ValueError unless ``weight`` is a number in [0, 1] (0 = pure RL, 1 = pure distillation)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1] (0 = pure RL, 1 = pure distillation), got {weight!r}")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{n} {s}" for n, s in shapes.items()))


def _check_topk_inputs(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, mask: torch.Tensor) -> None:
    _check_same_shape(student_topk_logp=student_topk_logp, teacher_topk_logp=teacher_topk_logp)
    if teacher_topk_logp.dim() < 1 or tuple(teacher_topk_logp.shape[:-1]) != tuple(mask.shape):
        raise ValueError(f"shape mismatch: top-k log-probs {tuple(teacher_topk_logp.shape)} should be "
                         f"mask {tuple(mask.shape)} plus a last dimension k")
    if teacher_topk_logp.shape[-1] < 1:
        raise ValueError("top-k must be a positive integer, got 0 (the top-k tensors' last dimension is empty)")


# ---------------------------------------------------------------------------------- reverse KL (PG)


def reverse_kl_sampled(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Per-token ``k1 = log pi(y_t) - log nu(y_t)`` (B, T) at the student's sampled tokens, detached.

    With ``y_t ~ pi(. | s_t)``, ``E[k1] = KL(pi || nu)`` at ``s_t`` (the reverse KL; it can be
    negative on one token). Detached on purpose: used *as a loss* its gradient would be
    ``grad log pi(y_t)``, whose expectation under ``pi`` is zero and which holds nothing of the
    teacher. The standard use (policy-gradient OPD) is ``-k1`` as a per-token advantage:
    :func:`reverse_kl_advantages`, :func:`reverse_kl_pg_loss`.

    >>> reverse_kl_sampled(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])).tolist()
    [[0.5, -1.0]]
    """
    _check_same_shape(student_logp=student_logp, teacher_logp=teacher_logp)
    return (student_logp - teacher_logp.to(student_logp.dtype)).detach()


def reverse_kl_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages ``-k1 = log nu(y_t) - log pi(y_t)`` (B, T), 0 on padding, no gradient.

    For any policy loss of ``POLICY_LOSSES`` (fitrl/algo/losses.py), in place of or added to the
    RL advantages: the teacher rewards tokens it finds likelier than the student does. Pass the
    student log-probs of the rollout's policy (``old_logp``), so the advantage stays fixed across
    the mini-batches of one step as a reward would; the policy loss's ratio corrects for the
    student having moved since.

    >>> m = torch.tensor([[1.0, 0.0]])
    >>> reverse_kl_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -float("inf")]]), m).tolist()
    [[-0.5, 0.0]]
    """
    _check_same_shape(student_logp=student_logp, teacher_logp=teacher_logp, mask=mask)
    valid = mask > 0
    k1 = reverse_kl_sampled(torch.where(valid, student_logp, 0.0), torch.where(valid, teacher_logp, 0.0))
    return torch.where(valid, -k1, torch.zeros_like(k1))


def reverse_kl_pg_loss(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy reverse-KL distillation: per token ``sg(k1_t) * exp(logp_t - sg(logp_t))``.

    ``student_logp`` (B, T) is the student's current log-prob of its sampled tokens, with graph;
    ``teacher_logp`` (B, T) the teacher's of the same tokens. The value is ``k1_t`` on every token,
    so the aggregate is the estimate of the reverse KL; the gradient on token t is
    ``k1_t * grad log pi(y_t)``: REINFORCE with reward ``-k1_t`` and no credit to later tokens.
    Its expectation over ``y_t ~ pi`` is exactly ``grad KL(pi(.|s_t) || nu(.|s_t))``, because
    ``E[grad log pi] = 0`` cancels the term the teacher-free part would add.

    This equals ``ppo_clip_loss(student_logp, student_logp.detach(), reverse_kl_advantages(...))``
    (ratio 1, so no clip is active); for an off-policy update (old log-probs, several
    mini-batches) use that form with the rollout's log-probs instead.

    >>> s = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    >>> loss, m = reverse_kl_pg_loss(s, torch.tensor([[-1.5, -1.0, -0.5]]), torch.ones(1, 3))
    >>> round(loss.item(), 4); loss.backward(); [round(g, 4) for g in s.grad[0].tolist()]
    -0.1667
    [0.1667, -0.3333, 0.0]
    """
    _check_same_shape(student_logp=student_logp, teacher_logp=teacher_logp, mask=mask)
    valid = mask > 0
    mask = mask.to(student_logp.dtype)
    logp = torch.where(valid, student_logp, 0.0)
    k1 = reverse_kl_sampled(logp, torch.where(valid, teacher_logp, 0.0))  # (B, T), no graph
    per_token = k1 * torch.exp(logp - logp.detach())  # value k1, gradient k1 * dlogp
    loss = aggregate(per_token, mask, agg_mode, denom)
    metrics = {"distill/reverse_kl": masked_mean(k1, mask),
               "distill/reverse_kl_abs": masked_mean(k1.abs(), mask)}
    return loss, metrics


# --------------------------------------------------------------------------------- top-k forward KL


def gather_topk_logp(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Student log-probs at the teacher's ids: logits (..., V), ids (..., K) long -> (..., K) fp32.

    ``logits.gather(ids) - logsumexp(logits)``: one fp32 copy of these logits and logsumexp's
    temporary, never a full log-softmax. A caller that must not hold the whole (B, T, V) calls
    it per chunk of tokens, as fitrl/ops/logprob.py does for one label per token, and concatenates
    the (chunk, K) results; with autograd each chunk keeps its logits for backward, so a chunked
    training pass needs the lm_head-fused form of ``_ChunkedHeadLogprobs`` there, with labels (N,)
    replaced by ids (N, K): its backward's ``-p * g`` takes ``g`` summed over K, and its
    ``scatter_add`` puts each of the K gradients at its id.
    """
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)} and top-k ids {tuple(ids.shape)} "
                         "should agree in all but the last dimension")
    check_topk(ids.shape[-1], logits.shape[-1])
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def topk_forward_kl_per_token(
    student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, *, tail_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token forward KL over the teacher's top-k tokens plus one tail bucket.

    Both inputs (..., K): log-probs over the *whole* vocabulary, taken at the teacher's top-k ids.
    With ``P = sum_k nu_k`` and ``Q = sum_k pi_k`` the masses there, the value is

        ``sum_k nu_k (log nu_k - log pi_k) + (1 - P) (log(1 - P) - log(1 - Q))``,

    the exact KL between teacher and student after merging every other token into one. Why this
    and not the alternatives: the bare top-k sum goes negative once the student puts more mass
    on the top-k than the teacher, and its minimum is the teacher renormalised to the top-k, not
    the teacher; renormalising both to the top-k ignores how much mass the student puts outside. The bucket form is >= 0, 0 when the student equals the teacher, a lower bound
    on the full forward KL (merging outcomes cannot raise a KL), and equal to it at K = V.
    ``1 - Q`` is floored at ``tail_eps`` so a student sure of the top-k cannot give ``log 0``.

    Returns (kl, teacher mass P, student mass Q, tail term), each (...).
    """
    if not 0.0 < tail_eps < 1.0:
        raise ValueError(f"tail_eps must be in (0, 1), got {tail_eps!r}")
    s, t = student_topk_logp.float(), teacher_topk_logp.float()
    teacher_p = t.exp()  # (..., K)
    head = (teacher_p * (t - s)).sum(-1)
    # tails from logsumexp: 1 - exp(lse) by expm1 keeps the small tails that matter when P -> 1
    teacher_lse, student_lse = torch.logsumexp(t, -1), torch.logsumexp(s, -1)  # log P, log Q
    teacher_tail = (-torch.expm1(teacher_lse)).clamp(min=0.0)  # an engine's top-k may sum past 1
    student_tail = (-torch.expm1(student_lse)).clamp(min=tail_eps)
    # where the teacher has no tail (K = V) the term is 0 log 0 = 0; the floor keeps log() finite
    # there, so the gradient through the unselected branch is 0, not 0 * inf = nan
    has_tail = teacher_tail > 0
    tail = torch.where(has_tail, teacher_tail * (teacher_tail.clamp(min=1e-30).log() - student_tail.log()),
                       torch.zeros_like(head))
    return head + tail, teacher_lse.exp().detach(), student_lse.exp().detach(), tail


def topk_forward_kl_gathered(
    student_topk_logp: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
    tail_eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Top-k forward KL loss from student log-probs already gathered at the teacher's ids.

    ``student_topk_logp`` (B, T, K) with graph: ``logit_at_id - logsumexp(all logits)`` per token
    (:func:`gather_topk_logp`, chunk by chunk), so nothing of size (B, T, V) is held here;
    ``teacher_topk_logp`` (B, T, K); ``mask`` (B, T). Per token as :func:`topk_forward_kl_per_token`,
    aggregated by ``agg_mode`` over ``denom`` like the policy losses (fitrl/algo/losses.py).
    """
    _check_topk_inputs(student_topk_logp, teacher_topk_logp, mask)
    valid = (mask > 0)[..., None]
    # padding: the same uniform-looking values on both sides, a finite KL of 0
    filler = -math.log(teacher_topk_logp.shape[-1] + 1)
    kl, teacher_mass, student_mass, tail = topk_forward_kl_per_token(
        torch.where(valid, student_topk_logp.float(), filler), torch.where(valid, teacher_topk_logp.float(), filler),
        tail_eps=tail_eps)
    mask = mask.to(kl.dtype)
    loss = aggregate(kl, mask, agg_mode, denom)
    with torch.no_grad():
        metrics = {"distill/forward_kl_topk": masked_mean(kl, mask),
                   "distill/forward_kl_tail": masked_mean(tail, mask),
                   "distill/teacher_topk_mass": masked_mean(teacher_mass, mask),
                   "distill/student_topk_mass": masked_mean(student_mass, mask)}
    return loss, metrics


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
    temperature: float = 1.0,
    tail_eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Top-k forward KL ``KL(nu || pi)`` from the student's full logits (B, T, V).

    ``teacher_topk_logp``, ``teacher_topk_ids`` (B, T, K): the teacher's k likeliest tokens per
    position and their log-probs over the whole vocabulary (k is their last dimension, 1 <= k <= V).
    Holds the (B, T, V) logits and one fp32 copy; callers with long responses and big vocabularies
    gather per chunk and call :func:`topk_forward_kl_gathered` instead.

    >>> z = torch.zeros(1, 1, 4); ids = torch.tensor([[[0, 1]]]); t = torch.log(torch.tensor([[[0.5, 0.25]]]))
    >>> loss, m = topk_forward_kl(z, t, ids, torch.ones(1, 1))  # student uniform: 0.5 log 2 + 0 + 0.25 log 0.5
    >>> round(loss.item(), 4), round(0.25 * math.log(2), 4), round(m["distill/student_topk_mass"].item(), 2)
    (0.1733, 0.1733, 0.5)
    """
    if teacher_topk_ids.shape != teacher_topk_logp.shape:
        raise ValueError(f"shape mismatch: teacher_topk_ids {tuple(teacher_topk_ids.shape)}, "
                         f"teacher_topk_logp {tuple(teacher_topk_logp.shape)}")
    if student_logits.dim() != teacher_topk_ids.dim() or student_logits.shape[:-1] != teacher_topk_ids.shape[:-1]:
        raise ValueError(f"shape mismatch: student_logits {tuple(student_logits.shape)} should be "
                         f"(B, T, V) with (B, T) of teacher_topk_ids {tuple(teacher_topk_ids.shape)}")
    student_topk_logp = gather_topk_logp(student_logits, teacher_topk_ids, temperature)  # (B, T, K)
    return topk_forward_kl_gathered(student_topk_logp, teacher_topk_logp, mask, agg_mode=agg_mode, denom=denom,
                                    tail_eps=tail_eps)


# ----------------------------------------------------------------------------------------- mixing


def mix_distill_loss(rl_loss: Optional[torch.Tensor], distill_loss: Optional[torch.Tensor],
                     distill_weight: float) -> torch.Tensor:
    """``(1 - w) * rl_loss + w * distill_loss``: 0 = pure RL, 1 = pure distillation.

    At the extremes the other loss is not touched and may be None (no teacher pass for pure RL,
    rewards off for pure distillation), and a nan in it cannot leak through ``0 * nan``. Aggregate
    both losses over the same :class:`Denominators` so that summing micro-batches still gives the
    mini-batch mix.

    >>> mix_distill_loss(torch.tensor(2.0), torch.tensor(4.0), 0.25).item()
    2.5
    >>> mix_distill_loss(torch.tensor(2.0), None, 0.0).item()
    2.0
    """
    check_distill_weight(distill_weight)
    if distill_weight == 0.0:
        if rl_loss is None:
            raise ValueError("distill_weight 0 (pure RL) needs the RL loss, got None")
        return rl_loss
    if distill_weight == 1.0:
        if distill_loss is None:
            raise ValueError("distill_weight 1 (pure distillation) needs the distillation loss, got None")
        return distill_loss
    if rl_loss is None or distill_loss is None:
        raise ValueError(f"distill_weight {distill_weight} mixes both losses; got None for "
                         f"{'the RL loss' if rl_loss is None else 'the distillation loss'}")
    return (1.0 - distill_weight) * rl_loss + distill_weight * distill_loss
