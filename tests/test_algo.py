"""RL math on hand-written tensors: values you can check on paper."""

import math

import pytest
import torch

from fitrl.algo.advantages import ADVANTAGE_ESTIMATORS, group_mean_std, grpo_advantages
from fitrl.algo.kl import KL_ESTIMATORS
from fitrl.algo.losses import POLICY_LOSSES, ppo_clip_loss, token_mean
from fitrl.config.schema import ConfigError


def test_group_mean_std_by_hand():
    values = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    mean, std, count = group_mean_std(values, groups)
    assert mean.tolist() == [2.0, 2.0, 2.0, 2.0, 5.0]
    # group 0: deviations +-1, unbiased var = (1+1)/1 = 2
    assert std.tolist() == pytest.approx([math.sqrt(2), math.sqrt(2), 0.0, 0.0, 0.0])
    assert count.tolist() == [2, 2, 2, 2, 1]


def test_grpo_advantages_by_hand():
    # one group of three: scores 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3)
    scores = torch.tensor([1.0, 0.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv, returns = grpo_advantages(scores, mask, torch.tensor([0, 0, 0]), eps=0.0)
    std = math.sqrt(1 / 3)
    expected = [(1 - 1 / 3) / std, (-1 / 3) / std, (-1 / 3) / std]  # 1.1547, -0.5774, -0.5774
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[0, 2] == 0 and adv[1, 1] == 0  # zero outside the response
    assert torch.equal(adv, returns)


def test_grpo_equal_scores_and_singletons_give_zero():
    adv, _ = grpo_advantages(torch.tensor([1.0, 1.0, 0.7]), torch.ones(3, 2), torch.tensor([0, 0, 1]))
    assert torch.all(adv == 0)


def test_grpo_matches_loop_reference():
    torch.manual_seed(0)
    scores = torch.rand(24)
    groups = torch.arange(6).repeat_interleave(4)[torch.randperm(24)]
    adv, _ = grpo_advantages(scores, torch.ones(24, 1), groups, eps=1e-6)
    for i in range(24):
        members = scores[groups == groups[i]]
        ref = (scores[i] - members.mean()) / (members.std() + 1e-6)
        assert adv[i, 0].item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # d = ref - logp = -ln 2
    assert KL_ESTIMATORS.get("k1")(logp, ref).item() == pytest.approx(math.log(2))
    assert KL_ESTIMATORS.get("k2")(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert KL_ESTIMATORS.get("k3")(logp, ref).item() == pytest.approx(0.5 - 1 + math.log(2))
    same = torch.tensor([-1.3, -0.2])
    for name in ("k1", "k2", "k3"):
        assert torch.all(KL_ESTIMATORS.get(name)(same, same) == 0)


def test_token_mean_with_global_denominator():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert token_mean(values, mask).item() == pytest.approx(3.0)  # (1+3+5)/3
    assert token_mean(values, mask, denominator=9.0).item() == pytest.approx(1.0)


def test_ppo_clip_by_hand():
    # ratios 1.5, 0.5, 1.1 with advantages +1, -1, -2 and clip 0.2
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped high); token 2: max(0.5, 0.8) = 0.8 (clipped low);
    # token 3: max(2.2, 2.2) = 2.2 (inside the range)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 2.2) / 3, rel=1e-5)
    assert m["actor/clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["actor/clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["actor/ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3, rel=1e-5)


def test_ppo_clip_gradient_is_zero_on_clipped_tokens():
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)  # d(-r/2)/dlogp at r=1


def test_registry_typo_names_nearest():
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        ADVANTAGE_ESTIMATORS.get("grpoo")
    with pytest.raises(ConfigError, match="valid: ppo_clip"):
        POLICY_LOSSES.get("nope")
