"""Advantage estimators. Each takes sequence scores and the response mask and returns
``(advantages, returns)``, both ``(B, T)`` and zero outside the response.

Samples of one prompt form a *group*; ``group_index`` (B,) holds small integers naming it.
"""

from __future__ import annotations

import torch

from fitrl.algo.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "algorithm.adv_estimator")


def group_mean_std(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and size of its group, vectorised with scatter-add.

    values (B,) float, group_index (B,) long in [0, G). Returns three (B,) tensors.
    A group of one has std 0 (there is no spread to measure).
    """
    num_groups = int(group_index.max()) + 1
    values = values.float()
    count = torch.zeros(num_groups, device=values.device).index_add_(0, group_index, torch.ones_like(values))
    total = torch.zeros(num_groups, device=values.device).index_add_(0, group_index, values)
    mean = total / count
    centred = values - mean[group_index]
    sq = torch.zeros(num_groups, device=values.device).index_add_(0, group_index, centred**2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[group_index], var.sqrt()[group_index], count[group_index]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group mean) / (group std + eps)``, the same value on every response token.

    >>> s = torch.tensor([1.0, 0.0, 0.0, 1.0]); g = torch.tensor([0, 0, 1, 1])
    >>> adv, _ = grpo_advantages(s, torch.ones(4, 2), g, norm_by_std=False)
    >>> adv[:, 0].tolist()
    [0.5, -0.5, -0.5, 0.5]

    A group of one gets advantage 0: with nothing to compare against it carries no signal.
    """
    mean, std, count = group_mean_std(scores, group_index)
    adv = scores.float() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    adv_tokens = adv[:, None] * response_mask
    return adv_tokens, adv_tokens
