"""Per-token KL estimators between the policy and the reference, from sampled log-probs, and the
KL coefficient controllers used when the KL penalty is in the reward.

With ``d = ref_logp - logp`` (both at the sampled token, sampled from the policy):
  k1 = -d                      unbiased, high variance, can be negative
  k2 = d^2 / 2                 biased, low variance, >= 0          (also registered as ``mse``)
  k3 = exp(d) - d - 1          unbiased, low variance, >= 0        (``low_var_kl``, Schulman 2020)
  abs = |d|                    biased, >= 0
"""

from __future__ import annotations

import torch

from fitrl.core.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator", "algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
@KL_ESTIMATORS.register("mse")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
@KL_ESTIMATORS.register("low_var_kl")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Clamp d so exp() cannot overflow on tokens where the policy and reference disagree wildly;
    # the value is capped at 10 nats per token, which only bites on degenerate tokens.
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=10.0)


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def kl_penalized_rewards(token_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                         mask: torch.Tensor, kl_fn, coef: float) -> tuple[torch.Tensor, float]:
    """PPO-style KL in the reward: ``r_t - coef * KL_t`` on response tokens, all (B, T).

    Returns the penalised rewards and the mean per-sequence KL (what the adaptive controller steers).

    >>> r = torch.tensor([[0.0, 1.0]]); lp = torch.tensor([[-1.0, -1.0]]); ref = torch.tensor([[-2.0, -1.0]])
    >>> out, seq_kl = kl_penalized_rewards(r, lp, ref, torch.ones(1, 2), KL_ESTIMATORS.get("k1"), 0.5)
    >>> out.tolist(), seq_kl
    ([[-0.5, 1.0]], 1.0)
    """
    kl = kl_fn(logp, ref_logp) * mask
    return token_rewards - coef * kl, kl.sum(-1).mean().item()


class FixedKLController:
    """A constant KL coefficient.

    >>> c = FixedKLController(0.1); c.update(current_kl=5.0, n_steps=64); c.value
    0.1
    """

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): steer the measured KL towards ``target_kl``.

    ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + error * n_steps / horizon``,
    with ``n_steps`` the number of sequences since the last update.

    >>> c = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=100)
    >>> c.update(current_kl=3.0, n_steps=50); round(c.value, 6)  # error capped at 0.2: 0.1 * 1.1
    0.11
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_coef)
        self.target_kl, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
