"""Per-token KL estimators between the policy and the reference, from sampled log-probs.

With ``d = ref_logp - logp`` (both at the sampled token, sampled from the policy):
  k1 = -d                      unbiased, high variance, can be negative
  k2 = d^2 / 2                 biased, low variance, >= 0
  k3 = exp(d) - d - 1          unbiased, low variance, >= 0 ("low_var_kl", Schulman 2020)
"""

from __future__ import annotations

import torch

from fitrl.algo.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", "algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Clamp d so exp() cannot overflow on tokens where the policy and reference disagree wildly;
    # the value is capped at 10 nats per token, which only bites on degenerate tokens.
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=10.0)
