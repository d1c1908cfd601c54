"""Advantage estimators. Each returns ``(advantages, returns)``, both ``(B, T)`` and zero outside
the response mask.

Every estimator takes keyword-only arguments drawn from one fixed vocabulary, so the loop can
offer everything it has and :func:`compute_advantages` passes each estimator just what it asks for:

  token_rewards    (B, T) float  reward per response token: the sequence score on the last
                                 response token, minus per-token KL penalties when KL is in the reward
  response_mask    (B, T)        1 on response tokens
  group_index      (B,) long     samples of one prompt share a group (small integers in [0, G))
  values           (B, T)        critic values (GAE only)
  baseline_scores  (B,)          score of the greedy response to the same prompt (ReMax only)
  gamma, lam, norm_adv_by_std, eps   scalars
"""

from __future__ import annotations

import inspect

import torch

from fitrl.algo.spec import ADVANTAGE_ESTIMATORS, estimator
from fitrl.core.errors import ConfigError

# What to tell the user when an estimator's input is missing (default: the parameter's name).
_NEEDS = {
    "values": "critic values: set up a critic (critic.model.path)",
    "baseline_scores": "baseline_scores: the score of a greedy response per prompt (the ReMax baseline rollout)",
}


def compute_advantages(name: str, **available) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up estimator ``name`` and call it with the entries of ``available`` it takes.

    Entries it does not take are ignored; one it requires that is missing or None raises
    ConfigError naming the estimator and what it needs. A None for a parameter with a default
    means "use the default".

    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]]); m = torch.ones(2, 2)
    >>> adv, _ = compute_advantages("drgrpo", token_rewards=r, response_mask=m,
    ...                             group_index=torch.tensor([0, 0]), values=None, gamma=1.0)
    >>> adv.tolist()
    [[0.5, 0.5], [-0.5, -0.5]]
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    kwargs = {}
    for param in inspect.signature(fn).parameters.values():
        value = available.get(param.name)
        if value is not None:
            kwargs[param.name] = value
        elif param.default is inspect.Parameter.empty:
            raise ConfigError(f"{name} needs {_NEEDS.get(param.name, param.name)}")
    return fn(**kwargs)


# ---------------------------------------------------------------------------------------- helpers


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


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sum of ``token_rewards`` over the response: the score, minus the KL penalty when it is in the reward."""
    return (token_rewards.float() * response_mask).sum(-1)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) zeros with ``scores`` (B,) on each sequence's last response token.

    >>> scores_to_token_rewards(torch.tensor([2.0, 3.0]), torch.tensor([[1, 1, 0], [1, 1, 1]])).tolist()
    [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0]]
    """
    mask = response_mask.float()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = (positions * mask).argmax(-1)  # (B,) index of the last valid token
    out = torch.zeros_like(mask)
    return out.scatter_(1, last[:, None], scores.float()[:, None]) * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and (population) std over the masked entries; 0 outside.

    >>> masked_whiten(torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[1, 1, 0]]), eps=0.0).tolist()
    [[-1.0, 1.0, 0.0]]
    """
    mask = mask.float()
    n = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / n
    return (values - mean) / (var.sqrt() + eps) * mask


def _discounted_cumsum(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) returns-to-go ``G_t = r_t + gamma * G_next`` over valid tokens only.

    Invalid positions are skipped (they neither add reward nor take a discount step), so a
    masked hole inside a response does not break the chain; the result is 0 outside the mask.
    """
    mask = mask.float()
    rewards = rewards.float() * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):  # T steps of (B,) work: cheap next to a forward pass
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_sequence[:, None] * response_mask.float()  # (B, T)
    return adv, adv


# ------------------------------------------------------------------------------------- estimators


@estimator("grpo", groups=True)
def grpo_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(s - group mean) / (group std + eps)``, the same value on every response token.

    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    >>> adv, _ = grpo_advantages(token_rewards=r, response_mask=torch.ones(4, 2),
    ...                          group_index=torch.tensor([0, 0, 1, 1]), norm_adv_by_std=False)
    >>> adv[:, 0].tolist()
    [0.5, -0.5, -0.5, 0.5]

    A group of one gets advantage 0: with nothing to compare against it carries no signal.
    """
    scores = sequence_scores(token_rewards, response_mask)  # (B,)
    mean, std, count = group_mean_std(scores, group_index)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv, response_mask)


@estimator("drgrpo", groups=True)
def drgrpo_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``s - group mean``, never divided by the std (which up-weights easy/hard prompts).

    Pair it with ``seq-mean-token-sum-norm`` aggregation to also remove the length bias.
    """
    return grpo_advantages(token_rewards=token_rewards, response_mask=response_mask,
                           group_index=group_index, norm_adv_by_std=False)


@estimator("rloo", groups=True)
def rloo_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``s_i - mean of the other members of i's group`` (= n/(n-1) * (s_i - group mean)).

    >>> r = torch.tensor([[3.0], [0.0], [0.0]])
    >>> rloo_advantages(token_rewards=r, response_mask=torch.ones(3, 1), group_index=torch.zeros(3, dtype=torch.long))[0][:, 0].tolist()
    [3.0, -1.5, -1.5]
    """
    scores = sequence_scores(token_rewards, response_mask)  # (B,)
    mean, _, count = group_mean_std(scores, group_index)
    # the leave-one-out mean is (n*mean - s_i)/(n-1); groups of one have no baseline -> 0
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(scores))
    return _broadcast(adv, response_mask)


@estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns-to-go of ``token_rewards``, whitened over the batch's valid tokens.

    Returns ``(whitened returns, raw returns)``; no critic and no group baseline.
    """
    returns = _discounted_cumsum(token_rewards, response_mask, gamma)  # (B, T)
    return masked_whiten(returns, response_mask, eps), returns


@estimator("reinforce_plus_plus_baseline", groups=True)
def reinforce_plus_plus_baseline_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``s - group mean`` on every response token, then whitened over the batch.

    Whitening is over tokens, so longer responses weigh more in the batch mean and std.
    """
    scores = sequence_scores(token_rewards, response_mask)
    mean, _, _ = group_mean_std(scores, group_index)
    adv, _ = _broadcast(scores - mean, response_mask)
    adv = masked_whiten(adv, response_mask, eps)
    return adv, adv


@estimator("remax", baseline=True)
def remax_advantages(
    *, token_rewards: torch.Tensor, response_mask: torch.Tensor, baseline_scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``s - score of the greedy response to the same prompt``, on every response token.

    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    >>> remax_advantages(token_rewards=r, response_mask=torch.ones(2, 2), baseline_scores=torch.tensor([0.25, 0.5]))[0].tolist()
    [[0.75, 0.75], [-0.5, -0.5]]
    """
    scores = sequence_scores(token_rewards, response_mask)
    return _broadcast(scores - baseline_scores.float(), response_mask)


@estimator("gae", critic=True)
def gae_advantages(
    *,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over valid tokens; ``returns = advantages + values`` (the critic's
    target), then the advantages are whitened over the batch's valid tokens.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next *valid* token and is 0 after the last one (the episode ends there).
    """
    mask = response_mask.float()
    rewards = token_rewards.float() * mask
    values = values.float() * mask
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        # invalid positions pass the running values through untouched
        next_adv = torch.where(valid, a_t, next_adv)
        next_value = torch.where(valid, values[:, t], next_value)
        adv[:, t] = a_t
    adv = adv * mask
    returns = (adv + values) * mask
    return masked_whiten(adv, mask, eps), returns
