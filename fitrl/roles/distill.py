"""The actor's on-policy distillation term (``algorithm.distill``, docs/algorithms.md): the loss of
fitrl/algo/distill.py on one micro-batch, from the teacher's columns of the batch
(fitrl/roles/teacher.py) and the student's forward, mixed with the policy loss by
:func:`~fitrl.algo.distill.mix_distill_loss` in ``Actor._micro_loss`` (fitrl/roles/actor.py).

Which form of the reverse KL: on-policy (the update's own forward is the behaviour policy, one
optimizer step on fresh samples) :func:`~fitrl.algo.distill.reverse_kl_pg_loss`; otherwise the
configured policy loss with :func:`~fitrl.algo.distill.reverse_kl_advantages` of the behaviour
log-probs, whose ratio corrects for the student having moved since it sampled (the algo
module's advice). The top-k forward KL differentiates the student's log-probs at the teacher's
ids directly (:func:`~fitrl.algo.distill.topk_forward_kl_gathered`), from the same forward as
the policy loss's log-probs (fitrl/roles/topk_heads.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from fitrl.algo.distill import (reverse_kl_advantages, reverse_kl_pg_loss, reverse_kl_sampled,
                                topk_forward_kl_gathered)
from fitrl.algo.losses import Denominators, masked_mean
from fitrl.config.algorithm import AlgorithmConfig
from fitrl.core.device import autocast
from fitrl.data.batch import Batch
from fitrl.roles.topk_heads import student_topk_logprobs


class DistillTerm:
    """One run's distillation settings, resolved once: the weight, the loss and its aggregation."""

    def __init__(self, algo: AlgorithmConfig, policy_loss: Callable):
        d = algo.distill
        self.weight = d.weight
        self.topk = d.loss == "topk_forward_kl"
        self.agg_mode = d.agg_mode or algo.loss_agg_mode
        self.solved_score = d.solved_score
        self.policy_loss = policy_loss

    def forward(self, actor, micro: Batch, temperature: float, entropy_grad: bool):
        """The student's (logp, entropy, log-probs at the teacher's top-k ids or None) of the
        micro-batch: one forward (the actor's own pass when no top-k is needed)."""
        if not self.topk:
            logp, entropy = actor._forward(micro, temperature, with_entropy=True, entropy_grad=entropy_grad)
            return logp, entropy, None
        a = actor.cfg
        with autocast(micro["input_ids"].device, actor.autocast_dtype):
            return student_topk_logprobs(
                actor.model, micro, micro["teacher_topk_ids"], temperature=temperature,
                chunk_size=a.logprob_chunk_size, entropy_grad=entropy_grad,
                model_kwargs=actor.inputs.extra(micro, micro["input_ids"].device), share_prompts=a.share_prompts,
                pack=a.packing)

    def loss(self, micro: Batch, logp: torch.Tensor, old_logprobs: torch.Tensor, student_topk: torch.Tensor | None,
             mask: torch.Tensor, denom: Denominators, *, on_policy: bool, **clip) -> tuple[torch.Tensor, dict]:
        """(distillation loss aggregated over the mini-batch's ``denom``, its metrics: this
        micro-batch's token means). ``clip``: the policy loss's clip ratios (the off-policy
        reverse KL's surrogate)."""
        teacher = micro["teacher_logprobs"]
        m = {}
        if self.solved_score is not None:  # solved responses: RL alone (their tokens count in denom, at 0)
            unsolved = (micro["scores"] < self.solved_score).to(mask.dtype)  # (B,)
            m["distill/distilled_fraction"] = unsolved.mean()
            mask = mask * unsolved[:, None]
        if self.topk:
            loss, lm = topk_forward_kl_gathered(student_topk, micro["teacher_topk_logprobs"], mask,
                                                agg_mode=self.agg_mode, denom=denom)
            m.update(lm)
        elif on_policy:
            loss, lm = reverse_kl_pg_loss(logp, teacher, mask, agg_mode=self.agg_mode, denom=denom)
            m.update(lm)
        else:
            advantages = reverse_kl_advantages(old_logprobs, teacher, mask)
            loss, _ = self.policy_loss(logp, old_logprobs, advantages, mask, agg_mode=self.agg_mode, denom=denom,
                                       **clip)
        if "distill/reverse_kl" not in m:  # the sampled tokens' KL under the current weights, whatever the loss
            valid = mask > 0
            k1 = reverse_kl_sampled(torch.where(valid, logp.detach(), 0.0), torch.where(valid, teacher, 0.0))
            m.update({"distill/reverse_kl": masked_mean(k1, mask), "distill/reverse_kl_abs": masked_mean(k1.abs(), mask)})
        return loss, m
