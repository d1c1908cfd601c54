"""Policy losses, the value loss and loss aggregation.

Aggregation divides by explicit :class:`Denominators` counted over the whole mini-batch (all
micro-batches, all ranks). Each micro-batch's aggregate is then its share of the mini-batch
value, and *summing* the micro-batch losses (gradient accumulation, DDP/FSDP gradient sum) gives
exactly the mini-batch loss and gradient. A per-micro-batch mean would instead weight the tokens
of short or small micro-batches up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from fitrl.core.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss", "algorithm.policy_loss")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation", "algorithm.loss_agg_mode")

Number = Union[float, torch.Tensor]  # a 0-dim tensor avoids a host sync when counted on device


@dataclass(frozen=True)
class Denominators:
    tokens: Number
    """Valid (masked) response tokens in the whole mini-batch."""
    sequences: Number
    """Sequences in the whole mini-batch."""
    max_response_length: int
    """The constant length Dr.GRPO's ``seq-mean-token-sum-norm`` divides by (``rollout.max_response_length``)."""

    @classmethod
    def from_mask(cls, mask: torch.Tensor, max_response_length: Optional[int] = None) -> "Denominators":
        """Local counts of one (B, T) mask: the right denominators when this mask is the whole mini-batch."""
        return cls(tokens=mask.sum().clamp(min=1), sequences=float(mask.shape[0]),
                   max_response_length=max_response_length or mask.shape[1])


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the masked entries (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


# ------------------------------------------------------------------------------------ aggregation


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, denom: Optional[Denominators] = None) -> torch.Tensor:
    """Reduce per-token ``values`` (B, T) to a scalar with aggregation ``mode``.

    ``denom`` holds the mini-batch-wide counts; None means this batch is the whole mini-batch.

    >>> v = torch.tensor([[1.0, 3.0], [5.0, 7.0]]); m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> [aggregate(v, m, mode).item() for mode in
    ...  ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")]
    [3.0, 4.5, 3.5, 2.25]
    """
    fn = LOSS_AGGREGATIONS.get(mode)
    mask = mask.to(values.dtype)
    return fn(values, mask, denom if denom is not None else Denominators.from_mask(mask))


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor, denom: Denominators) -> torch.Tensor:
    """Every valid token weighs the same: ``sum(values * mask) / tokens`` (DAPO)."""
    return (values * mask).sum() / denom.tokens


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, denom: Denominators) -> torch.Tensor:
    """Sum over each sequence's tokens, mean over sequences (longer sequences weigh more)."""
    return (values * mask).sum(-1).sum() / denom.sequences


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, denom: Denominators) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences (original GRPO; every sequence weighs the same)."""
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return per_seq.sum() / denom.sequences


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, denom: Denominators) -> torch.Tensor:
    """Dr.GRPO: token sum over a *constant* ``sequences * max_response_length``, so no length bias."""
    return (values * mask).sum() / (denom.sequences * denom.max_response_length)


# ---------------------------------------------------------------------------------- policy losses


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    # clamp: an overflowing exp() times a zero advantage would be NaN, and masking cannot remove NaN
    return (logp - old_logp).clamp(-20.0, 20.0)


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Ratio statistics over valid tokens and the k1 estimate of KL(old || current)."""
    # torch.where rather than ratio[mask > 0]: boolean indexing would sync with the host
    valid = mask > 0
    any_valid = valid.any()
    ratio_max = torch.where(valid, ratio, torch.full_like(ratio, -float("inf"))).max()
    ratio_min = torch.where(valid, ratio, torch.full_like(ratio, float("inf"))).min()
    return {
        "actor/ratio_mean": masked_mean(ratio, mask),
        "actor/ratio_max": torch.where(any_valid, ratio_max, torch.zeros_like(ratio_max)),
        "actor/ratio_min": torch.where(any_valid, ratio_min, torch.zeros_like(ratio_min)),
        "actor/approx_kl": masked_mean(-log_ratio, mask),
    }


def _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high, mask):
    """Per-token ``max(-A r, -A clip(r, 1-lo, 1+hi))`` (B, T) and its clip-fraction metrics."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        # the clip is active (and the token's gradient zero) where the clipped term wins strictly:
        # A > 0 with r > 1+hi ("high") or A < 0 with r < 1-lo ("low")
        active = clipped > unclipped
        low = (active & (advantages < 0)).float()
        high = (active & (advantages > 0)).float()
        metrics = {
            "actor/clip_frac": masked_mean(active.float(), mask),
            "actor/clip_frac_low": masked_mean(low, mask),
            "actor/clip_frac_high": masked_mean(high, mask),
        }
    return per_token, metrics


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token, ``max(-A r, -A clip(r, 1-lo, 1+hi))``, r = exp(logp - old_logp).

    Asymmetric bounds give DAPO's clip-higher (``clip_ratio_high > clip_ratio_low``). With
    ``clip_ratio_c > 1`` the dual clip (Ye et al. 2020) also caps the loss of A < 0 tokens at
    ``-A * clip_ratio_c``, so a token whose ratio exploded cannot dominate the batch.
    All inputs (B, T). ``actor/clip_frac`` counts the ratio clip (low + high);
    ``actor/dual_clip_frac`` the dual clip (0 when it is off).
    """
    mask = mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)  # (B, T)
    per_token, metrics = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high, mask)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c > 1.0:
        cap = -advantages * clip_ratio_c  # (B, T), positive where A < 0
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    metrics["actor/dual_clip_frac"] = masked_mean(dual.float(), mask)
    loss = aggregate(per_token, mask, agg_mode, denom)
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "seq-mean-token-mean",
    denom: Optional[Denominators] = None,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clip on the sequence-level ratio
    ``s_i = exp(mean over i's valid tokens of (logp - old_logp))``.

    Written per token as ``s_i.detach() * exp(logp - logp.detach())``: the value is ``s_i`` on every
    token and the gradient on token t is ``s_i * dlogp_t``, so with ``seq-mean-token-mean`` it is
    exactly the gradient of the sequence objective (``ds_i/dlogp_t = s_i / |y_i|``), while other
    aggregations re-weight sequences. ``clip_ratio_c`` is ignored. The ratio metrics are over
    ``s_i`` repeated on each valid token; ``actor/approx_kl`` is per token.
    """
    mask = mask.to(logp.dtype)
    token_log_ratio = _log_ratio(logp, old_logp)  # (B, T)
    seq_log_ratio = (token_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    log_ratio = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # (B, T), value = seq_log_ratio
    ratio = torch.exp(log_ratio)
    per_token, metrics = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high, mask)
    loss = aggregate(per_token, mask, agg_mode, denom)
    with torch.no_grad():
        metrics.update(_ratio_metrics(ratio, token_log_ratio, mask))
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): per token ``-sg(min(r, 1 + clip_ratio_high)) * A * logp``.

    The importance weight is clipped and stop-gradient, but unlike PPO no token loses its gradient:
    every token contributes ``-w * A * dlogp``. ``actor/clip_frac`` (= ``clip_frac_high``) counts the
    tokens whose weight was truncated; ``clip_ratio_low`` and ``clip_ratio_c`` are ignored.
    """
    mask = mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)  # (B, T)
    weight = ratio.clamp(max=1.0 + clip_ratio_high).detach()
    per_token = -weight * advantages * logp
    loss = aggregate(per_token, mask, agg_mode, denom)
    with torch.no_grad():
        truncated = masked_mean((ratio > 1.0 + clip_ratio_high).float(), mask)
        metrics = {"actor/clip_frac": truncated, "actor/clip_frac_low": torch.zeros_like(truncated),
                   "actor/clip_frac_high": truncated}
        metrics.update(_ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


# ------------------------------------------------------------------------------------- value loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    agg_mode: str = "token-mean",
    denom: Optional[Denominators] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped value loss per token, ``0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2)``.

    All inputs (B, T). Metrics: ``critic/vf_clip_frac`` (tokens where the clipped term wins, so
    the gradient is zero), ``critic/values_mean``, ``critic/vf_explained_var`` (1 - Var(R - v) / Var(R)).
    """
    mask = mask.to(values.dtype)
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = aggregate(per_token, mask, agg_mode, denom)
    with torch.no_grad():
        residual = returns - values
        var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
        var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
        metrics = {
            "critic/vf_clip_frac": masked_mean((clipped_sq > unclipped_sq).float(), mask),
            "critic/values_mean": masked_mean(values, mask),
            "critic/vf_explained_var": 1.0 - var_residual / var_returns.clamp(min=1e-8),
        }
    return loss, metrics
