"""Policy losses and loss aggregation.

Aggregation takes an explicit ``denominator``: under micro-batching the trainer passes the
token count of the whole mini-batch, so summing micro-batch losses gives exactly the
mini-batch token mean (a per-micro-batch mean would weight short micro-batches up).
"""

from __future__ import annotations

from typing import Optional

import torch

from fitrl.algo.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss", "algorithm.policy_loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation", "algorithm.loss_agg_mode")


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor, denominator: Optional[float] = None) -> torch.Tensor:
    """Sum of ``values`` over masked tokens divided by ``denominator`` (default: this mask's token count).

    >>> token_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(3.)
    """
    if denominator is None:
        denominator = mask.sum().clamp(min=1)
    return (values * mask).sum() / denominator


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    agg_mode: str = "token-mean",
    denominator: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, per token: ``-min(r * A, clip(r, 1-lo, 1+hi) * A)``, r = exp(logp - old_logp).

    All inputs (B, T). Returns the aggregated loss and token-mean metrics over ``mask``:
    ``clip_frac_low/high`` (tokens whose gradient the clip removed), ``ratio_mean``, ``approx_kl``
    (k1 between old and current policy).
    """
    # clamp: an overflowing exp() times a zero advantage would be NaN, and masking cannot remove NaN
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = LOSS_AGGREGATIONS.get(agg_mode)(per_token, mask, denominator)
    with torch.no_grad():
        clip_active = clipped > unclipped
        metrics = {
            "actor/clip_frac": masked_mean(clip_active.float(), mask),
            "actor/clip_frac_low": masked_mean((clip_active & (advantages < 0)).float(), mask),
            "actor/clip_frac_high": masked_mean((clip_active & (advantages > 0)).float(), mask),
            "actor/ratio_mean": masked_mean(ratio, mask),
            "actor/approx_kl": masked_mean(-log_ratio, mask),
        }
    return loss, metrics
