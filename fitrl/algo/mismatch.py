"""Rollout vs trainer log-probs: how far the rollout engine's numbers are from the trainer's, and
truncated importance sampling (TIS) to correct for it.

A rollout engine with other kernels or precision (vLLM) samples from pi_rollout, slightly off the
trainer's pi_trainer under the same weights. The policy loss's ratio is taken against the trainer's
old log-probs, so the samples are off-policy by pi_trainer / pi_rollout; TIS multiplies each token's
loss by that ratio, truncated at ``cap`` (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; veRL's ``rollout_is``).

All inputs (B, R): log-probs of the sampled tokens and the response mask. Pure tensor math.
:func:`mismatch_jump` reads the result across steps: an engine whose weights a push or a wake
corrupted (fitrl/trainer/stops.py stops the run on it).
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

import torch

IS_LEVELS = ("token", "sequence")

_MAX_LOG = 20.0  # exp(20) ~ 5e8: the metrics stay finite when log-probs are wildly apart


def _log_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                 level: str) -> torch.Tensor:
    """(B, R) untruncated log importance weights; 0 at masked positions (whatever they hold)."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance-sampling level {level!r} is not one of {IS_LEVELS}")
    valid = mask > 0
    # torch.where, not a product with the mask: padding may hold -inf, and -inf * 0 is NaN
    log_w = torch.where(valid, trainer_logprobs.float() - rollout_logprobs.float(), 0.0)  # (B, R)
    if level == "sequence":  # log of the product of the token ratios, on each of the sequence's tokens
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    return log_w


def truncated_is_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         level: str, cap: float) -> torch.Tensor:
    """(B, R) detached TIS weights ``min(pi_trainer / pi_rollout, cap)``.

    ``token``: w_t = min(exp(trainer_t - rollout_t), cap). ``sequence``: one weight per sequence,
    w = min(exp(sum over its real tokens of (trainer - rollout)), cap), on each of its tokens.
    Computed in log space as ``exp(min(log w, log cap))`` (the same value): a large log difference
    gives the cap, never inf or NaN; a very negative one underflows to 0. Masked positions get 0.

    >>> t = torch.tensor([[-1.0, -2.0]]); r = torch.tensor([[-1.5, -1.0]]); m = torch.ones(1, 2)
    >>> truncated_is_weights(t, r, m, "token", cap=1.5).tolist()  # [exp(0.5) > 1.5, exp(-1)]
    [[1.5, 0.3678794503211975]]
    >>> truncated_is_weights(t, r, m, "sequence", cap=1.5).tolist()  # exp(0.5 - 1) on both
    [[0.6065306663513184, 0.6065306663513184]]
    """
    log_w = _log_weights(trainer_logprobs, rollout_logprobs, mask, level)
    w = log_w.clamp(max=math.log(cap)).exp()
    return torch.where(mask > 0, w, 0.0).detach()


def mismatch_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *,
                     level: Optional[str] = None, cap: float = 2.0) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's, over the real tokens.

    With d = trainer - rollout per sampled token:

    - ``rollout/logprob_diff_mean``, ``rollout/logprob_diff_max``: mean and max of |d|;
    - ``rollout/kl``: KL(pi_rollout || pi_trainer) per token, the k3 estimator on the sampled
      tokens (drawn from pi_rollout): the token mean of exp(d) - 1 - d (>= 0 per token; d is
      clamped to +-20 so one wild token cannot make it inf);
    - ``rollout/ppl_ratio``: perplexity of the responses under the trainer over that under the
      rollout engine, exp(-mean d) (1 when they agree; > 1 when the engine is the sharper; the
      exponent clamped to +-20 too);
    - with ``level`` (the correction's, see :func:`truncated_is_weights`): ``rollout/is_weight_mean``,
      the token mean of the weights the loss uses, and ``rollout/is_clipped_frac``, the fraction of
      tokens whose weight the cap truncated (at ``sequence`` level: the tokens of truncated sequences).

    An empty mask gives 0 for every value (1 for the ratio), not NaN.

    >>> t = torch.tensor([[-1.0, -2.0]]); r = torch.tensor([[-1.5, -1.0]]); m = torch.ones(1, 2)
    >>> [round(v, 4) for v in mismatch_metrics(t, r, m, level="token", cap=1.5).values()]  # d = [0.5, -1]
    [0.75, 1.0, 0.2583, 1.284, 0.9339, 0.5]
    """
    valid = mask > 0
    count = valid.sum().clamp(min=1)
    # float64 and expm1: exp(d) - 1 - d ~ d^2 / 2 vanishes in float32 for d below ~1e-3
    d = torch.where(valid, trainer_logprobs.double() - rollout_logprobs.double(), 0.0)  # (B, R)
    dc = d.clamp(-_MAX_LOG, _MAX_LOG)
    values = {
        "rollout/logprob_diff_mean": d.abs().sum() / count,
        "rollout/logprob_diff_max": d.abs().max() if d.numel() else d.new_zeros(()),  # 0 on padding
        "rollout/kl": (torch.expm1(dc) - dc).sum() / count,  # 0 on padding: exp(0) - 1 - 0
        "rollout/ppl_ratio": torch.exp((-d.sum() / count).clamp(-_MAX_LOG, _MAX_LOG)),
    }
    if level is not None:
        log_w = _log_weights(trainer_logprobs, rollout_logprobs, mask, level)
        w = truncated_is_weights(trainer_logprobs, rollout_logprobs, mask, level, cap)
        values["rollout/is_weight_mean"] = w.double().sum() / count
        values["rollout/is_clipped_frac"] = ((log_w > math.log(cap)) & valid).double().sum() / count
    return dict(zip(values, torch.stack(list(values.values())).tolist()))  # one host sync


def mismatch_jump(kl: float, recent: Sequence[float], *, floor: float, factor: float) -> Optional[float]:
    """The bound a step's ``rollout/kl`` crossed, or None: above ``floor`` and above ``factor``
    times the median of ``recent`` (the run's last steps; none yet: the floor alone). A sound
    engine's distance from the trainer is steady (precision, kernels); weights that a push or a
    wake corrupted make it jump by orders of magnitude. Non-finite counts as crossed; ``floor``
    0 disables.

    >>> mismatch_jump(2.0, [1e-6, 2e-6, 1e-6], floor=0.1, factor=10.0)  # 10 x 1e-6 < 0.1: the floor
    0.1
    >>> mismatch_jump(0.3, [0.05, 0.04, 0.06], floor=0.1, factor=10.0) is None  # within 10 x 0.05
    True
    """
    if not floor:
        return None
    bound = max(floor, factor * statistics.median(recent)) if recent else floor
    return bound if not math.isfinite(kl) or kl > bound else None
