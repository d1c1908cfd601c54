"""Advantage estimators on hand-written tensors, and the vectorised code against slow loops."""

import math

import pytest
import torch

from fitrl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    drgrpo_advantages,
    gae_advantages,
    group_mean_std,
    grpo_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)
from fitrl.config.schema import ConfigError


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), **kw)


def rewards_of(scores, mask):
    return scores_to_token_rewards(torch.tensor(scores), torch.tensor(mask))


# ------------------------------------------------------------------------------------------- GRPO


def test_group_mean_std_by_hand():
    values = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    mean, std, count = group_mean_std(values, groups)
    assert mean.tolist() == [2.0, 2.0, 2.0, 2.0, 5.0]
    # group 0: deviations +-1, unbiased var = (1+1)/1 = 2
    assert std.tolist() == pytest.approx([math.sqrt(2), math.sqrt(2), 0.0, 0.0, 0.0])
    assert count.tolist() == [2, 2, 2, 2, 1]


def test_scores_to_token_rewards_puts_the_score_on_the_last_response_token():
    r = rewards_of([2.0, 3.0, 4.0], [[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert r.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]  # empty response: nothing


def test_grpo_by_hand():
    # one group of three: scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    r = scores_to_token_rewards(torch.tensor([1.0, 0.0, 0.0]), mask)
    adv, returns = grpo_advantages(token_rewards=r, response_mask=mask, group_index=torch.tensor([0, 0, 0]), eps=0.0)
    std = math.sqrt(1 / 3)
    expected = [(1 - 1 / 3) / std, (-1 / 3) / std, (-1 / 3) / std]  # 1.1547, -0.5774, -0.5774
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[0, 1].item() == pytest.approx(expected[0], rel=1e-5)  # the same on every response token
    assert adv[0, 2] == 0 and adv[1, 1] == 0 and adv[1, 2] == 0  # zero outside the response
    assert torch.equal(adv, returns)


def test_grpo_score_is_the_masked_sum_of_token_rewards():
    # KL in the reward: per-token penalties sit on every token; the 5.0 is padding and must be ignored
    r = torch.tensor([[-0.1, -0.1, 1.0, 5.0], [-0.2, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    adv, _ = grpo_advantages(token_rewards=r, response_mask=mask, group_index=torch.tensor([0, 0]), norm_adv_by_std=False)
    # scores 0.8 and -0.2, mean 0.3 -> +0.5 and -0.5
    close(adv, [[0.5, 0.5, 0.5, 0.0], [-0.5] * 4])


def test_grpo_equal_scores_and_singletons_give_zero():
    r = rewards_of([1.0, 1.0, 0.7], [[1, 1]] * 3)
    adv, _ = grpo_advantages(token_rewards=r, response_mask=torch.ones(3, 2), group_index=torch.tensor([0, 0, 1]))
    assert torch.all(adv == 0)


def test_drgrpo_by_hand_never_divides_by_std():
    # group scores 2, 0, 1: mean 1 -> 1, -1, 0 (GRPO would divide by std 1 here too, so use a second group)
    # group 2 scores 4, 0: mean 2 -> 2, -2 (GRPO: 2 / sqrt(8) = 0.7071)
    r = rewards_of([2.0, 0.0, 1.0, 4.0, 0.0], [[1]] * 5)
    adv, ret = drgrpo_advantages(token_rewards=r, response_mask=torch.ones(5, 1), group_index=torch.tensor([0, 0, 0, 1, 1]))
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0, 2.0, -2.0]
    assert torch.equal(adv, ret)


def test_grpo_matches_loop_reference():
    torch.manual_seed(0)
    scores = torch.rand(24)
    groups = torch.arange(6).repeat_interleave(4)[torch.randperm(24)]
    r = scores_to_token_rewards(scores, torch.ones(24, 1))
    adv, _ = grpo_advantages(token_rewards=r, response_mask=torch.ones(24, 1), group_index=groups, eps=1e-6)
    for i in range(24):
        members = scores[groups == groups[i]]
        ref = (scores[i] - members.mean()) / (members.std() + 1e-6)
        assert adv[i, 0].item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------------------------- RLOO


def test_rloo_by_hand():
    # group 0 scores 3, 0, 0: baselines (0+0)/2 = 0, (3+0)/2 = 1.5, 1.5 -> 3, -1.5, -1.5
    # group 1 scores 1, 0: baselines 0, 1 -> 1, -1; group 2 is a singleton -> 0
    r = rewards_of([3.0, 0.0, 0.0, 1.0, 0.0, 7.0], [[1, 1]] * 6)
    adv, ret = rloo_advantages(token_rewards=r, response_mask=torch.ones(6, 2), group_index=torch.tensor([0, 0, 0, 1, 1, 2]))
    assert adv[:, 0].tolist() == [3.0, -1.5, -1.5, 1.0, -1.0, 0.0]
    assert torch.equal(adv[:, 0], adv[:, 1]) and torch.equal(adv, ret)


def test_rloo_matches_loop_reference():
    torch.manual_seed(1)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])[torch.randperm(10)]
    scores = torch.randn(10)
    adv, _ = rloo_advantages(token_rewards=scores[:, None], response_mask=torch.ones(10, 1), group_index=groups)
    for i in range(10):
        others = [scores[j].item() for j in range(10) if groups[j] == groups[i] and j != i]
        ref = scores[i].item() - sum(others) / len(others) if others else 0.0
        assert adv[i, 0].item() == pytest.approx(ref, abs=1e-6)


# ------------------------------------------------------------------------------------ REINFORCE++


def slow_returns_to_go(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        running = 0.0
        for t in reversed(valid):  # holes are skipped: no reward, no discount step
            running = rewards[b, t].item() + gamma * running
            out[b, t] = running
    return out


def test_reinforce_plus_plus_by_hand():
    # gamma 0.5. row 0 rewards 0, 0, 1 -> returns 0.25, 0.5, 1; row 1 rewards 0, 1, (pad) -> 0.5, 1, 0
    # valid returns 0.25, 0.5, 1, 0.5, 1: mean 3.25/5 = 0.65, deviations -0.4, -0.15, 0.35, -0.15, 0.35,
    # population var (0.16 + 0.0225 + 0.1225 + 0.0225 + 0.1225)/5 = 0.09, std 0.3
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(token_rewards=r, response_mask=mask, gamma=0.5, eps=0.0)
    close(ret, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    close(adv, [[-4 / 3, -0.5, 7 / 6], [-0.5, 7 / 6, 0.0]])


def test_returns_to_go_match_slow_loop_with_holes():
    torch.manual_seed(2)
    r = torch.randn(6, 9)
    mask = (torch.rand(6, 9) > 0.3).long()
    mask[0] = 0  # an empty response
    _, ret = reinforce_plus_plus_advantages(token_rewards=r, response_mask=mask, gamma=0.9)
    torch.testing.assert_close(ret, slow_returns_to_go(r, mask, 0.9))


def test_reinforce_plus_plus_baseline_by_hand():
    # group 0 scores 1, -1 (mean 0) -> 1, -1 on two tokens each; group 1 scores 3, 3 -> 0, 0 on one token each
    # tokens 1, 1, -1, -1, 0, 0: mean 0, population var 4/6 = 2/3 -> whitened +-1/sqrt(2/3) = +-1.2247, 0
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0]])
    r = scores_to_token_rewards(torch.tensor([1.0, -1.0, 3.0, 3.0]), mask)
    adv, ret = reinforce_plus_plus_baseline_advantages(
        token_rewards=r, response_mask=mask, group_index=torch.tensor([0, 0, 1, 1]), eps=0.0)
    a = 1 / math.sqrt(2 / 3)
    close(adv, [[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_masked_whiten_uses_only_valid_tokens():
    # valid 1, 3: mean 2, population std 1 -> -1, 1; the 99 is padding
    out = masked_whiten(torch.tensor([[1.0, 3.0, 99.0]]), torch.tensor([[1, 1, 0]]), eps=0.0)
    assert out.tolist() == [[-1.0, 1.0, 0.0]]


# ------------------------------------------------------------------------------------------ ReMax


def test_remax_by_hand():
    # scores 1 and 0 against greedy baselines 0.25 and 0.5 -> 0.75 and -0.5
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    r = scores_to_token_rewards(torch.tensor([1.0, 0.0]), mask)
    adv, ret = remax_advantages(token_rewards=r, response_mask=mask, baseline_scores=torch.tensor([0.25, 0.5]))
    assert adv.tolist() == [[0.75, 0.75, 0.75], [-0.5, 0.0, 0.0]]
    assert torch.equal(adv, ret)


# -------------------------------------------------------------------------------------------- GAE


def slow_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        running, next_value = 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t], next_value = running, values[b, t].item()
    return adv


def test_gae_by_hand():
    # gamma = lam = 0.5. row 0: rewards 0, 0, 1; values 0.5 everywhere
    #   t2: delta = 1 + 0.5*0 - 0.5 = 0.5;          A2 = 0.5
    #   t1: delta = 0 + 0.5*0.5 - 0.5 = -0.25;      A1 = -0.25 + 0.25*0.5 = -0.125
    #   t0: delta = -0.25;                          A0 = -0.25 + 0.25*(-0.125) = -0.28125
    # row 1: rewards 0, 2, (pad); values 1, 1, (9 pad)
    #   t1: delta = 2 + 0 - 1 = 1;                  A1 = 1
    #   t0: delta = 0 + 0.5*1 - 1 = -0.5;           A0 = -0.5 + 0.25*1 = -0.25
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    v = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(token_rewards=r, response_mask=mask, values=v, gamma=0.5, lam=0.5, eps=0.0)
    raw = torch.tensor([[-0.28125, -0.125, 0.5], [-0.25, 1.0, 0.0]])
    close(ret, [[0.21875, 0.375, 1.0], [0.75, 2.0, 0.0]])  # returns = A + V
    valid = raw[mask.bool()]
    expected = (raw - valid.mean()) / valid.std(unbiased=False) * mask
    torch.testing.assert_close(adv, expected)


def test_gae_with_gamma_lam_one_is_monte_carlo_return_minus_value():
    torch.manual_seed(3)
    r, v, mask = torch.randn(4, 6), torch.randn(4, 6), torch.ones(4, 6)
    _, ret = gae_advantages(token_rewards=r, response_mask=mask, values=v, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, r.flip(-1).cumsum(-1).flip(-1))  # A + V = sum of future rewards


def test_gae_matches_slow_loop_with_holes():
    torch.manual_seed(4)
    r, v = torch.randn(5, 8), torch.randn(5, 8)
    mask = (torch.rand(5, 8) > 0.25).long()
    _, ret = gae_advantages(token_rewards=r, response_mask=mask, values=v, gamma=0.9, lam=0.8)
    ref = slow_gae(r, v, mask, 0.9, 0.8)
    torch.testing.assert_close(ret, (ref + v) * mask)


# ------------------------------------------------------------------------------ compute_advantages


def everything(B=6, T=4):
    torch.manual_seed(5)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 2:] = 0
    return dict(token_rewards=torch.randn(B, T), response_mask=mask, group_index=torch.arange(B) // 2,
                values=torch.randn(B, T), baseline_scores=torch.randn(B), gamma=0.99, lam=0.95,
                norm_adv_by_std=True, eps=1e-6)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_through_compute_advantages(name):
    available = everything()
    adv, ret = compute_advantages(name, **available)
    assert adv.shape == ret.shape == (6, 4)
    assert torch.all(adv[0, 2:] == 0) and torch.all(ret[0, 2:] == 0)  # zero outside the mask
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_compute_advantages_passes_only_what_the_estimator_takes():
    a = everything()
    adv, _ = compute_advantages("drgrpo", **a)  # ignores norm_adv_by_std, values, baseline_scores, ...
    ref, _ = drgrpo_advantages(token_rewards=a["token_rewards"], response_mask=a["response_mask"],
                               group_index=a["group_index"])
    assert torch.equal(adv, ref)
    a["norm_adv_by_std"] = False
    assert torch.equal(compute_advantages("grpo", **a)[0], ref)


def test_compute_advantages_none_means_default_for_optional_knobs():
    a = everything()
    a.update(gamma=None, eps=None)
    adv, _ = compute_advantages("reinforce_plus_plus", **a)
    ref, _ = reinforce_plus_plus_advantages(token_rewards=a["token_rewards"], response_mask=a["response_mask"])
    assert torch.equal(adv, ref)


def test_compute_advantages_says_what_is_missing():
    a = everything()
    a["values"] = None
    with pytest.raises(ConfigError, match=r"gae needs critic values: set up a critic \(critic.model.path\)"):
        compute_advantages("gae", **a)
    del a["baseline_scores"]
    with pytest.raises(ConfigError, match="remax needs baseline_scores"):
        compute_advantages("remax", **a)
    with pytest.raises(ConfigError, match="rloo needs group_index"):
        compute_advantages("rloo", token_rewards=a["token_rewards"], response_mask=a["response_mask"])
    with pytest.raises(ConfigError, match="did you mean 'rloo'"):
        compute_advantages("rlooo", **a)
