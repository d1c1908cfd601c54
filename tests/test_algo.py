"""RL math on hand-written tensors: registries, KL estimators and controllers, DAPO filtering and
overlong shaping, and the doctests of every fitrl.algo module. Estimators and losses have their
own files (test_algo_advantages.py, test_algo_losses.py)."""

import doctest
import importlib
import math

import pytest
import torch

from fitrl.algo.advantages import ADVANTAGE_ESTIMATORS
from fitrl.algo.filtering import group_is_informative
from fitrl.algo.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController
from fitrl.algo.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from fitrl.algo.shaping import overlong_penalty
from fitrl.config.schema import ConfigError

ALGO_MODULES = ["spec", "advantages", "losses", "kl", "filtering", "shaping", "mismatch"]


@pytest.mark.parametrize("module", ALGO_MODULES)
def test_doctests(module):
    result = doctest.testmod(importlib.import_module(f"fitrl.algo.{module}"))
    assert result.failed == 0


def test_registries_list_every_variant():
    assert ADVANTAGE_ESTIMATORS.names() == sorted(
        ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"])
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]
    assert LOSS_AGGREGATIONS.names() == sorted(
        ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
    assert KL_ESTIMATORS.names() == ["abs", "k1", "k2", "k3", "low_var_kl", "mse"]


def test_registry_typo_names_nearest():
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        ADVANTAGE_ESTIMATORS.get("grpoo")
    with pytest.raises(ConfigError, match="valid: cispo, gspo, ppo_clip"):
        POLICY_LOSSES.get("nope")
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode='token_mean'; did you mean 'token-mean'"):
        LOSS_AGGREGATIONS.get("token_mean")


# ---------------------------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    # d = ref - logp = -ln 2
    kl = {name: KL_ESTIMATORS.get(name)(logp, ref).item() for name in KL_ESTIMATORS.names()}
    assert kl["k1"] == pytest.approx(math.log(2))  # -d
    assert kl["k2"] == kl["mse"] == pytest.approx(0.5 * math.log(2) ** 2)  # d^2/2 = 0.2402
    assert kl["k3"] == kl["low_var_kl"] == pytest.approx(0.5 - 1 + math.log(2))  # e^d - d - 1 = 0.1931
    assert kl["abs"] == pytest.approx(math.log(2))  # |d|
    # the other direction: d = +ln 2 -> k1 = -ln 2 (k1 can be negative), abs = ln 2, k3 = 2 - ln 2 - 1 = 0.3069
    back = {name: KL_ESTIMATORS.get(name)(ref, logp).item() for name in ("k1", "abs", "k3")}
    assert back == pytest.approx({"k1": -math.log(2), "abs": math.log(2), "k3": 1 - math.log(2)})
    same = torch.tensor([-1.3, -0.2])
    for name in KL_ESTIMATORS.names():
        assert torch.all(KL_ESTIMATORS.get(name)(same, same) == 0), name


def test_k3_is_finite_on_wild_disagreement():
    out = KL_ESTIMATORS.get("k3")(torch.tensor([-100.0, 0.0]), torch.tensor([0.0, -100.0]))
    assert torch.isfinite(out).all() and out.max() <= 10.0


def test_fixed_kl_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=10.0, n_steps=1000)
    assert c.value == 0.05


def test_adaptive_kl_controller_by_hand():
    c = AdaptiveKLController(init_coef=0.1, target_kl=1.0, horizon=100)
    c.update(current_kl=3.0, n_steps=50)  # error 3/1 - 1 = 2, clipped to 0.2: 0.1 * (1 + 0.2*50/100) = 0.11
    assert c.value == pytest.approx(0.11)
    c.update(current_kl=1.05, n_steps=100)  # error 0.05: 0.11 * 1.05 = 0.1155
    assert c.value == pytest.approx(0.1155)
    c.update(current_kl=0.0, n_steps=100)  # error -1, clipped to -0.2: 0.1155 * 0.8 = 0.0924
    assert c.value == pytest.approx(0.0924)
    c.update(current_kl=1.0, n_steps=100)  # on target: unchanged
    assert c.value == pytest.approx(0.0924)


# -------------------------------------------------------------------------------- DAPO filtering


def test_group_is_informative_by_hand():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    # group 0 all 1, group 1 mixed, group 2 all 0, group 3 a singleton, group 4 mixed
    assert group_is_informative(values, groups).tolist() == [False, False, True, True, False, False, False,
                                                             True, True, True]


def test_group_is_informative_matches_loop():
    torch.manual_seed(7)
    groups = torch.arange(8).repeat_interleave(4)[torch.randperm(32)]
    values = torch.randint(0, 2, (32,)).float()
    got = group_is_informative(values, groups)
    for i in range(32):
        assert got[i].item() == (len(set(values[groups == groups[i]].tolist())) > 1)


# ------------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_by_hand():
    # max 10, buffer 4, factor 0.5: free up to 6 tokens, then -0.5 * (len - 6)/4
    lengths = torch.tensor([1, 6, 7, 8, 10])
    got = overlong_penalty(lengths, max_response_length=10, buffer_length=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_overlong_penalty_rejects_a_bad_buffer():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([3]), max_response_length=4, buffer_length=0, penalty_factor=1.0)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([3]), max_response_length=4, buffer_length=5, penalty_factor=1.0)
