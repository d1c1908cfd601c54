"""Loss aggregation, policy losses and the value loss on hand-written tensors; micro-batch invariance."""

import math

import pytest
import torch

from fitrl.algo.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    Denominators,
    aggregate,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
    value_loss,
)

MODES = LOSS_AGGREGATIONS.names()
SPLITS = [1, 4, 8]  # micro-batches of an 8-sequence mini-batch: 1 x 8, 4 x 2, 8 x 1


def close(actual, expected, **kw):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), **kw)


# ------------------------------------------------------------------------------------ aggregation


def test_aggregation_modes_by_hand_local_counts():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # valid tokens 1, 3 | 5 (the 7 is padding); 3 tokens, 2 sequences, T = 2
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(3.0)  # (1+3+5)/3
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(4.5)  # (4 + 5)/2
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.5)  # (4/2 + 5/1)/2
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(2.25)  # 9/(2*2)


def test_aggregation_modes_by_hand_global_denominators():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])  # long masks work too
    d = Denominators(tokens=9.0, sequences=3.0, max_response_length=3)
    assert aggregate(values, mask, "token-mean", d).item() == pytest.approx(1.0)  # 9/9
    assert aggregate(values, mask, "seq-mean-token-sum", d).item() == pytest.approx(3.0)  # (4 + 5)/3
    assert aggregate(values, mask, "seq-mean-token-mean", d).item() == pytest.approx(7 / 3)  # (2 + 5)/3
    assert aggregate(values, mask, "seq-mean-token-sum-norm", d).item() == pytest.approx(1.0)  # 9/(3*3)


def test_denominators_from_mask():
    d = Denominators.from_mask(torch.tensor([[1, 1, 0], [1, 0, 0]]), max_response_length=8)
    assert (float(d.tokens), d.sequences, d.max_response_length) == (3.0, 2.0, 8)
    with pytest.raises(Exception):
        d.tokens = 4.0  # frozen


# ----------------------------------------------------------------------- micro-batch invariance


def toy_batch(seed=0, B=8, T=6, D=3):
    """A toy policy logp = (theta * features).sum(-1), ragged lengths, ratios far enough from 1 to clip."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(B, T, D, generator=g)
    theta = torch.randn(D, generator=g).requires_grad_()
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 1])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # (B, T)
    with torch.no_grad():
        old_logp = (theta * features).sum(-1) + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).clone()
    return theta, features, old_logp, adv, mask


def grad_over_micro_batches(loss_of, theta, features, mask, n_micro):
    """Sum the micro-batch losses (all with the mini-batch's Denominators) and return theta.grad."""
    theta.grad = None
    denom = Denominators(tokens=mask.sum(), sequences=mask.shape[0], max_response_length=mask.shape[1])
    total = 0.0
    for idx in torch.arange(mask.shape[0]).chunk(n_micro):
        logp = (theta * features[idx]).sum(-1)  # (b, T)
        loss = loss_of(logp, idx, denom)
        loss.backward()
        total += loss.item()
    return theta.grad.clone(), total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_micro", SPLITS)
def test_aggregation_is_invariant_to_micro_batching(mode, n_micro):
    theta, features, _, adv, mask = toy_batch()
    weights = torch.linspace(-1, 2, 8 * 6).view(8, 6)

    def loss_of(logp, idx, denom):
        return aggregate(weights[idx] * logp**2, mask[idx], mode, denom)

    full_grad, full_loss = grad_over_micro_batches(loss_of, theta, features, mask, 1)
    grad, loss = grad_over_micro_batches(loss_of, theta, features, mask, n_micro)
    assert loss == pytest.approx(full_loss, rel=1e-5)
    torch.testing.assert_close(grad, full_grad)
    # and the full-batch value equals aggregate() with local counts
    with torch.no_grad():
        local = aggregate(weights * (theta * features).sum(-1) ** 2, mask, mode)
    assert local.item() == pytest.approx(full_loss, rel=1e-5)


def test_per_micro_batch_means_would_not_be_invariant():
    # why the Denominators exist: averaging token means of ragged micro-batches changes the gradient
    theta, features, _, _, mask = toy_batch()

    def loss_of(logp, idx, denom):
        return aggregate(logp**2, mask[idx], "token-mean") / 4  # local mean, 4 micro-batches

    full, _ = grad_over_micro_batches(lambda lp, i, d: aggregate(lp**2, mask[i], "token-mean", d), theta, features, mask, 1)
    split, _ = grad_over_micro_batches(loss_of, theta, features, mask, 4)
    assert not torch.allclose(full, split, rtol=1e-3)


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_micro", SPLITS)
def test_policy_losses_are_invariant_to_micro_batching(loss_name, mode, n_micro):
    theta, features, old_logp, adv, mask = toy_batch(seed=1)
    fn = POLICY_LOSSES.get(loss_name)
    knobs = dict(agg_mode=mode, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5)

    def loss_of(logp, idx, denom):
        return fn(logp, old_logp[idx], adv[idx], mask[idx], denom=denom, **knobs)[0]

    full_grad, full_loss = grad_over_micro_batches(loss_of, theta, features, mask, 1)
    grad, loss = grad_over_micro_batches(loss_of, theta, features, mask, n_micro)
    assert loss == pytest.approx(full_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, full_grad)
    assert full_grad.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_micro", SPLITS)
def test_value_loss_is_invariant_to_micro_batching(mode, n_micro):
    theta, features, old_values, returns, mask = toy_batch(seed=2)

    def loss_of(values, idx, denom):
        return value_loss(values, old_values[idx], returns[idx], mask[idx], cliprange_value=0.2, agg_mode=mode, denom=denom)[0]

    full_grad, full_loss = grad_over_micro_batches(loss_of, theta, features, mask, 1)
    grad, loss = grad_over_micro_batches(loss_of, theta, features, mask, n_micro)
    assert loss == pytest.approx(full_loss, rel=1e-5)
    torch.testing.assert_close(grad, full_grad)


# --------------------------------------------------------------------------------------- PPO clip


def test_ppo_clip_by_hand():
    # ratios 1.5, 0.5, 1.1 with advantages +1, -1, -2 and clip 0.2
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # token 1: max(-1.5, -1.2) = -1.2 (clipped high); token 2: max(0.5, 0.8) = 0.8 (clipped low);
    # token 3: max(2.2, 2.2) = 2.2 (inside the range; the dual clip cap 3 * 2 = 6 is far)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 2.2) / 3, rel=1e-5)
    assert m["actor/clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["actor/clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["actor/clip_frac"].item() == pytest.approx(2 / 3)
    assert m["actor/dual_clip_frac"].item() == 0
    assert m["actor/ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3, rel=1e-5)
    assert m["actor/ratio_max"].item() == pytest.approx(1.5)
    assert m["actor/ratio_min"].item() == pytest.approx(0.5)
    # approx_kl = mean(old - logp) = -(ln 1.5 + ln 0.5 + ln 1.1)/3 = -ln(0.825)/3 = 0.0641
    assert m["actor/approx_kl"].item() == pytest.approx(-math.log(0.825) / 3, rel=1e-5)


def test_ppo_clip_gradient_is_zero_on_clipped_tokens():
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert logp.grad[0, 0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)  # d(-r/2)/dlogp at r=1


def test_ppo_clip_higher_is_asymmetric():
    # low 0.2, high 0.28: ratio 1.25 (A=+1) is inside [0.8, 1.28] -> -1.25; 1.3 -> clipped to -1.28;
    # 0.75 (A=-1) -> max(0.75, 0.8) = 0.8 clipped low; 0.85 (A=-1) -> 0.85 inside
    logp = torch.log(torch.tensor([[1.25, 1.3, 0.75, 0.85]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_ratio_low=0.2, clip_ratio_high=0.28,
                            agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.25 - 1.28 + 0.8 + 0.85, rel=1e-5)  # one sequence: plain sum
    assert m["actor/clip_frac_high"].item() == pytest.approx(0.25)
    assert m["actor/clip_frac_low"].item() == pytest.approx(0.25)


def test_dual_clip_by_hand():
    # clip 0.2, clip_ratio_c 3. Token 1: r = 5, A = -1: PPO loss max(5, 1.2) = 5, dual cap 3 -> 3, no gradient.
    # Token 2: r = 2, A = -1: loss 2 < 3 -> 2, gradient d(-A r)/dlogp = r = 2.
    # Token 3: r = 5, A = +1: max(-5, -1.2) = -1.2 (ordinary high clip; the dual clip only touches A < 0).
    # Token 4 is padding with a huge ratio and must not show in any metric.
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0, 1e6]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 4), adv, mask, clip_ratio_c=3.0, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.2, rel=1e-5)
    loss.backward()
    close(logp.grad, [[0.0, 2.0, 0.0, 0.0]])
    assert m["actor/dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["actor/ratio_max"].item() == pytest.approx(5.0)
    # without the dual clip token 1 costs 5
    off, m_off = ppo_clip_loss(logp, torch.zeros(1, 4), adv, mask, clip_ratio_c=0.0, agg_mode="seq-mean-token-sum")
    assert off.item() == pytest.approx(5.0 + 2.0 - 1.2, rel=1e-5)
    assert m_off["actor/dual_clip_frac"].item() == 0


def test_huge_log_ratio_with_zero_advantage_is_not_nan():
    logp = torch.tensor([[200.0, -1.0]], requires_grad=True)
    for name in POLICY_LOSSES.names():
        loss, m = POLICY_LOSSES.get(name)(logp, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), name
        assert all(torch.isfinite(v) for v in m.values()), name


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_policy_loss_reports_the_metrics(name):
    theta, features, old_logp, adv, mask = toy_batch()
    logp = (theta * features).sum(-1)
    _, m = POLICY_LOSSES.get(name)(logp, old_logp, adv, mask, agg_mode="token-mean", denom=None,
                                   clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "ratio_min", "approx_kl"):
        assert m[f"actor/{key}"].dim() == 0 and not m[f"actor/{key}"].requires_grad, key


# ------------------------------------------------------------------------------------------- GSPO


def test_gspo_by_hand():
    # clip 0.2 both sides. seq 0: log-ratios ln 2, 0 -> mean ln2/2 -> s = sqrt 2 = 1.414 > 1.2 with A = +1:
    #   clipped, -1.2 on each token. seq 1: log-ratios 0.1, -0.1 (the 7 is padding) -> s = 1, A = -1: +1 each.
    # seq-mean-token-mean: (-1.2 + 1)/2 = -0.1; 2 of 4 valid tokens clipped high.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[math.log(2.0), 0.0, 0.0], [0.1, -0.1, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    loss, m = gspo_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-0.1, rel=1e-5)
    assert m["actor/clip_frac_high"].item() == pytest.approx(0.5)
    assert m["actor/clip_frac_low"].item() == 0
    assert m["actor/ratio_max"].item() == pytest.approx(math.sqrt(2), rel=1e-5)
    assert m["actor/ratio_min"].item() == pytest.approx(1.0, rel=1e-5)


def test_gspo_gradient_equals_the_sequence_level_objective():
    torch.manual_seed(6)
    B, T = 6, 5
    lengths = torch.tensor([5, 2, 4, 1, 3, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    old = torch.randn(B, T)
    logp = (old + 0.05 * torch.randn(B, T)).requires_grad_()
    adv_seq = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5])
    low, high = 0.01, 0.015

    # the objective as written in the paper: one ratio per sequence, PPO clip, mean over sequences
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # (B,)
    seq_obj = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - low, 1 + high)).mean()
    (expected,) = torch.autograd.grad(seq_obj, logp)

    adv = adv_seq[:, None] * mask
    loss, m = gspo_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean", clip_ratio_low=low, clip_ratio_high=high)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, seq_obj)
    torch.testing.assert_close(grad, expected)
    assert 0 < m["actor/clip_frac"].item() < 1  # the test covers both clipped and unclipped sequences
    assert torch.all(grad[mask == 0] == 0)


# ------------------------------------------------------------------------------------------ CISPO


def test_cispo_by_hand_and_gradient_on_clipped_tokens():
    # ratios 2 and 1 (old = 0), A = +1, clip_ratio_high 0.2: weights min(2, 1.2) = 1.2 and 1 (stop-gradient)
    # loss per token -w * A * logp = -1.2 ln 2 and 0; token-mean: -0.6 ln 2
    # gradient of the token-mean: -w * A / 2 = -0.6 and -0.5 -- nonzero on the clipped token, where PPO has 0
    logp = torch.log(torch.tensor([[2.0, 1.0]])).requires_grad_()
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, m = cispo_loss(logp, torch.zeros(1, 2), adv, mask, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-0.6 * math.log(2), rel=1e-5)
    loss.backward()
    close(logp.grad, [[-0.6, -0.5]])
    assert m["actor/clip_frac"].item() == pytest.approx(0.5)  # one weight truncated
    ppo_logp = logp.detach().clone().requires_grad_()
    ppo_clip_loss(ppo_logp, torch.zeros(1, 2), adv, mask, clip_ratio_high=0.2)[0].backward()
    assert ppo_logp.grad[0, 0] == 0


# ------------------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # cliprange 0.5.
    # token 1: v = 1, old 0.5, R = 1: v - old = 0.5 is inside, both errors 0 -> 0
    # token 2: v = 2, old 1, R = 3: clipped v = 1.5; max((2-3)^2, (1.5-3)^2) = max(1, 2.25) -> 0.5*2.25 = 1.125,
    #          the clipped term wins, so no gradient
    # token 3: v = 0, old 0, R = 1: 0.5 * 1 = 0.5, gradient d/dv 0.5 (v-R)^2 = v - R = -1
    # token 4: padding. token-mean: (0 + 1.125 + 0.5)/3 = 0.541667
    values = torch.tensor([[1.0, 2.0, 0.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.5, 1.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 3.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = value_loss(values, old, returns, mask, cliprange_value=0.5, agg_mode="token-mean")
    assert loss.item() == pytest.approx(1.625 / 3, rel=1e-5)
    loss.backward()
    close(values.grad, [[0.0, 0.0, -1 / 3, 0.0]])
    assert m["critic/vf_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["critic/values_mean"].item() == pytest.approx(1.0)  # (1 + 2 + 0)/3
    # explained variance: Var(R) over 1, 3, 1 = 8/9; Var(R - v) over 0, 1, 1 = 2/9 -> 1 - (2/9)/(8/9) = 0.75
    assert m["critic/vf_explained_var"].item() == pytest.approx(0.75, rel=1e-5)
