"""On-policy distillation losses (fitrl/algo/distill.py) on hand-written tensors: reverse KL on the
sampled tokens and top-k forward KL, masks, every aggregation mode, gradients against the
analytic values, invariances, the RL/distillation mix and bad input."""

import doctest
import math

import pytest
import torch

from fitrl.algo import distill
from fitrl.algo.distill import (
    check_distill_weight,
    check_topk,
    gather_topk_logp,
    mix_distill_loss,
    reverse_kl_advantages,
    reverse_kl_pg_loss,
    reverse_kl_sampled,
    topk_forward_kl,
    topk_forward_kl_gathered,
    topk_forward_kl_per_token,
)
from fitrl.algo.losses import LOSS_AGGREGATIONS, Denominators, aggregate, ppo_clip_loss

MODES = LOSS_AGGREGATIONS.names()
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 2 sequences x 3 tokens, the last one padding


def by_mode(seq0, seq1):
    """The four aggregations of per-token values seq0 (3 tokens) and seq1 (2 valid of 3), by hand."""
    return {"token-mean": (sum(seq0) + sum(seq1)) / 5,
            "seq-mean-token-sum": (sum(seq0) + sum(seq1)) / 2,
            "seq-mean-token-mean": (sum(seq0) / 3 + sum(seq1) / 2) / 2,
            "seq-mean-token-sum-norm": (sum(seq0) + sum(seq1)) / (2 * 3)}


def test_doctests():
    assert doctest.testmod(distill).failed == 0


def test_every_aggregation_has_a_hand_value():
    assert sorted(by_mode([0.0] * 3, [0.0] * 2)) == MODES


# ------------------------------------------------------------------------------ reverse KL (PG)

STUDENT_LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 9.0]])  # 9.0: garbage on padding
TEACHER_LOGP = torch.tensor([[-1.5, -1.0, -0.5], [-2.3, -0.2, -float("inf")]])  # no teacher score there
K1 = ([0.5, -1.0, 0.0], [2.0, -1.0])  # log pi - log nu on the valid tokens


def test_reverse_kl_sampled_and_advantages_by_hand():
    k1 = reverse_kl_sampled(STUDENT_LOGP[:, :2], TEACHER_LOGP[:, :2])
    torch.testing.assert_close(k1, torch.tensor([[0.5, -1.0], [2.0, -1.0]]))
    adv = reverse_kl_advantages(STUDENT_LOGP, TEACHER_LOGP, MASK)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 1.0, 0.0], [-2.0, 1.0, 0.0]]))  # 0 on padding, not nan
    logp = STUDENT_LOGP.clone().requires_grad_()
    assert not reverse_kl_sampled(logp, TEACHER_LOGP).requires_grad  # no gradient by construction


@pytest.mark.parametrize("mode", MODES)
def test_reverse_kl_pg_loss_by_hand_each_mode(mode):
    logp = STUDENT_LOGP.clone().requires_grad_()
    loss, metrics = reverse_kl_pg_loss(logp, TEACHER_LOGP, MASK, agg_mode=mode)
    assert loss.item() == pytest.approx(by_mode(*K1)[mode])
    assert metrics["distill/reverse_kl"].item() == pytest.approx(0.1)  # (0.5 - 1 + 0 + 2 - 1) / 5
    assert metrics["distill/reverse_kl_abs"].item() == pytest.approx(0.9)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[1, 2] == 0  # padding: no gradient


def test_reverse_kl_gradient_wrt_logits_is_the_analytic_value():
    """d/dz of ``k1 * exp(logp - sg logp)`` with logp = log_softmax(z)[y] is ``k1 * (onehot(y) - softmax(z))``,
    divided by the valid-token count under token-mean."""
    torch.manual_seed(0)
    z = torch.randn(2, 3, 5, requires_grad=True)
    y = torch.tensor([[0, 3, 4], [2, 2, 1]])
    teacher = torch.log_softmax(torch.randn(2, 3, 5), -1).gather(-1, y[..., None]).squeeze(-1)
    logp = torch.log_softmax(z, -1).gather(-1, y[..., None]).squeeze(-1)
    loss, _ = reverse_kl_pg_loss(logp, teacher, MASK)
    loss.backward()
    with torch.no_grad():
        k1 = logp - teacher
        expected = (MASK * k1 / 5)[..., None] * (torch.nn.functional.one_hot(y, 5) - torch.softmax(z, -1))
    torch.testing.assert_close(z.grad, expected)


def test_reverse_kl_expected_gradient_is_the_exact_reverse_kl_gradient():
    """Summed over every token y with weight pi(y), the per-sample gradient is grad KL(pi || nu) exactly."""
    z = torch.tensor([0.3, -1.0, 2.0, 0.0, 0.5], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5, 2.0, 0.1]), -1)
    exact = (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - teacher)).sum()
    (exact_grad,) = torch.autograd.grad(exact, z)
    expected_grad = torch.zeros(5)
    for y in range(5):
        logp = torch.log_softmax(z, -1)[y].reshape(1, 1)
        loss, _ = reverse_kl_pg_loss(logp, teacher[y].reshape(1, 1), torch.ones(1, 1))
        (g,) = torch.autograd.grad(loss, z)
        expected_grad += torch.softmax(z, -1)[y].detach() * g
    torch.testing.assert_close(expected_grad, exact_grad)


@pytest.mark.parametrize("mode", MODES)
def test_reverse_kl_pg_loss_is_ppo_clip_on_policy_with_distill_advantages(mode):
    logp_a = STUDENT_LOGP.clone().requires_grad_()
    logp_b = STUDENT_LOGP.clone().requires_grad_()
    ours, _ = reverse_kl_pg_loss(logp_a, TEACHER_LOGP, MASK, agg_mode=mode)
    adv = reverse_kl_advantages(STUDENT_LOGP, TEACHER_LOGP, MASK)
    ppo, _ = ppo_clip_loss(torch.where(MASK > 0, logp_b, 0.0), torch.where(MASK > 0, logp_b, 0.0).detach(), adv,
                           MASK, agg_mode=mode)
    torch.testing.assert_close(ours, ppo)
    ours.backward()
    ppo.backward()
    torch.testing.assert_close(logp_a.grad, logp_b.grad)


# ------------------------------------------------------------------------------- top-k forward KL

A = [0.5, 0.25, 0.125, 0.0625, 0.0625]  # a teacher (and once a student) distribution over 5 tokens
B = [0.1, 0.1, 0.6, 0.1, 0.1]
U = [0.2] * 5
IDS = {"A": [0, 1], "B": [2, 0]}  # each teacher's top-2 (B's tie broken by hand)
# KL with the tail bucket, by hand: sum over the top-2 of p log(p/q), then (1 - P) log((1 - P)/(1 - Q))
KL_AU = 0.5 * math.log(0.5 / 0.2) + 0.25 * math.log(0.25 / 0.2) + 0.25 * math.log(0.25 / 0.6)
KL_BU = 0.6 * math.log(0.6 / 0.2) + 0.1 * math.log(0.1 / 0.2) + 0.3 * math.log(0.3 / 0.6)
KL_BA = 0.6 * math.log(0.6 / 0.125) + 0.1 * math.log(0.1 / 0.5) + 0.3 * math.log(0.3 / 0.375)
LAYOUT = [[("A", U), ("A", A), ("B", U)], [("B", A), ("A", U), ("A", U)]]  # the last one is padding
TOPK_BY_HAND = ([KL_AU, 0.0, KL_BU], [KL_BA, KL_AU])


def topk_case():
    """Student logits (2, 3, 5) with a different constant per position, teacher top-2 log-probs and ids."""
    offsets = torch.tensor([[3.0, -7.0, 0.0], [11.0, 0.5, -2.0]])
    logits = torch.tensor([[[math.log(q) for q in student] for _, student in row] for row in LAYOUT])
    logits = logits + offsets[..., None]
    ids = torch.tensor([[IDS[t] for t, _ in row] for row in LAYOUT])
    teacher = {"A": A, "B": B}
    logp = torch.tensor([[[math.log(teacher[t][i]) for i in IDS[t]] for t, _ in row] for row in LAYOUT])
    logp[1, 2] = -float("inf")  # padding holds anything
    return logits, logp, ids


@pytest.mark.parametrize("mode", MODES)
def test_topk_forward_kl_by_hand_each_mode(mode):
    logits, teacher_logp, ids = topk_case()
    logits.requires_grad_()
    loss, metrics = topk_forward_kl(logits, teacher_logp, ids, MASK, agg_mode=mode)
    assert loss.item() == pytest.approx(by_mode(*TOPK_BY_HAND)[mode], rel=1e-5)
    assert metrics["distill/teacher_topk_mass"].item() == pytest.approx((0.75 * 3 + 0.7 * 2) / 5)
    assert metrics["distill/student_topk_mass"].item() == pytest.approx((0.4 + 0.75 + 0.4 + 0.625 + 0.4) / 5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[1, 2] == 0).all()


def full_forward_kl(student_logits, teacher_logits):
    """KL(nu || pi) over the whole vocabulary, per position (B, T)."""
    t, s = torch.log_softmax(teacher_logits, -1), torch.log_softmax(student_logits, -1)
    return (t.exp() * (t - s)).sum(-1)


def random_case(seed, k, vocab=5, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    student = (scale * torch.randn(2, 3, vocab, generator=g)).requires_grad_()
    teacher = scale * torch.randn(2, 3, vocab, generator=g)
    teacher_logp, ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    return student, teacher, teacher_logp, ids


@pytest.mark.parametrize("mode", MODES)
def test_topk_equals_full_forward_kl_at_k_vocab(mode):
    student, teacher, teacher_logp, ids = random_case(1, k=5)
    loss, _ = topk_forward_kl(student, teacher_logp, ids, MASK, agg_mode=mode)
    reference = aggregate(full_forward_kl(student, teacher), MASK, mode)
    torch.testing.assert_close(loss, reference)
    (g_ours,) = torch.autograd.grad(loss, student)
    (g_ref,) = torch.autograd.grad(reference, student)
    torch.testing.assert_close(g_ours, g_ref)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_topk_is_nonnegative_and_a_lower_bound_on_the_full_kl(k):
    for seed in range(20):
        student, teacher, teacher_logp, ids = random_case(seed, k, scale=4.0)
        kl, *_ = topk_forward_kl_per_token(gather_topk_logp(student, ids), teacher_logp)
        assert (kl >= -1e-6).all()
        # fp32: the tail masses come from 1 - exp(logsumexp(top-k)), 2e-5 relative at worst here
        assert (kl <= full_forward_kl(student, teacher) * (1 + 1e-4) + 1e-5).all()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_topk_is_zero_when_student_equals_teacher(k):
    student, _, _, _ = random_case(2, k)
    teacher_logp, ids = torch.log_softmax(student.detach(), -1).topk(k, dim=-1)
    loss, _ = topk_forward_kl(student, teacher_logp, ids, MASK)
    assert abs(loss.item()) < 1e-6
    (grad,) = torch.autograd.grad(loss, student)
    assert grad.abs().max().item() < 1e-5  # a minimum, not just a zero


def test_topk_is_invariant_to_a_constant_added_to_logits():
    student, teacher, teacher_logp, ids = random_case(3, k=2)
    shift = torch.tensor([[5.0, -3.0, 100.0], [0.1, -50.0, 7.0]])[..., None]
    base, _ = topk_forward_kl(student, teacher_logp, ids, MASK)
    shifted_teacher_logp = torch.log_softmax(teacher + shift, -1).gather(-1, ids)
    moved, _ = topk_forward_kl(student + shift, shifted_teacher_logp, ids, MASK)
    torch.testing.assert_close(moved, base)


def test_chunked_gather_equals_the_full_logits_form():
    """A caller that never holds (B, T, V): gather per chunk of tokens, then the gathered form."""
    student, _, teacher_logp, ids = random_case(4, k=3)
    full, full_metrics = topk_forward_kl(student, teacher_logp, ids, MASK)
    flat_logits, flat_ids = student.reshape(6, 5), ids.reshape(6, 3)
    gathered = torch.cat([gather_topk_logp(flat_logits[i:i + 2], flat_ids[i:i + 2]) for i in range(0, 6, 2)])
    chunked, chunked_metrics = topk_forward_kl_gathered(gathered.view(2, 3, 3), teacher_logp, MASK)
    torch.testing.assert_close(chunked, full)
    assert chunked_metrics.keys() == full_metrics.keys()
    (g_full,) = torch.autograd.grad(full, student)
    (g_chunked,) = torch.autograd.grad(chunked, student)
    torch.testing.assert_close(g_chunked, g_full)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_sum_to_the_mini_batch_loss(mode):
    """With mini-batch Denominators, one micro-batch per sequence sums to the whole (fitrl/algo/losses.py)."""
    student, _, teacher_logp, ids = random_case(5, k=2)
    denom = Denominators.from_mask(MASK)
    whole_topk, _ = topk_forward_kl(student, teacher_logp, ids, MASK, agg_mode=mode, denom=denom)
    parts_topk = sum(topk_forward_kl(student[i:i + 1], teacher_logp[i:i + 1], ids[i:i + 1], MASK[i:i + 1],
                                     agg_mode=mode, denom=denom)[0] for i in range(2))
    torch.testing.assert_close(parts_topk, whole_topk)
    whole_rkl, _ = reverse_kl_pg_loss(STUDENT_LOGP, TEACHER_LOGP, MASK, agg_mode=mode, denom=denom)
    parts_rkl = sum(reverse_kl_pg_loss(STUDENT_LOGP[i:i + 1], TEACHER_LOGP[i:i + 1], MASK[i:i + 1],
                                       agg_mode=mode, denom=denom)[0] for i in range(2))
    torch.testing.assert_close(parts_rkl, whole_rkl)


def test_topk_tail_floor_keeps_a_sure_student_finite():
    """A student with all its mass on the teacher's top-1 while the teacher keeps a tail: log(1 - Q) is floored."""
    student = torch.tensor([[[40.0, 0.0, 0.0]]], requires_grad=True)  # Q = 1 in fp32
    teacher_logp, ids = torch.log(torch.tensor([[[0.9]]])), torch.tensor([[[0]]])
    loss, _ = topk_forward_kl(student, teacher_logp, ids, torch.ones(1, 1), tail_eps=1e-6)
    expected = 0.9 * math.log(0.9) + 0.1 * (math.log(0.1) - math.log(1e-6))
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    loss.backward()
    assert torch.isfinite(student.grad).all()


# ----------------------------------------------------------------------------------------- mixing


def test_mix_extremes_are_the_pure_losses():
    logits, teacher_logp, ids = topk_case()
    distill_loss, _ = topk_forward_kl(logits, teacher_logp, ids, MASK)
    rl_loss, _ = ppo_clip_loss(STUDENT_LOGP[:, :2], STUDENT_LOGP[:, :2] + 0.1, torch.ones(2, 2), torch.ones(2, 2))
    assert mix_distill_loss(rl_loss, distill_loss, 0.0) is rl_loss
    assert mix_distill_loss(rl_loss, distill_loss, 1.0) is distill_loss
    assert mix_distill_loss(rl_loss, None, 0.0) is rl_loss  # pure RL needs no teacher pass
    assert mix_distill_loss(None, distill_loss, 1) is distill_loss  # pure distillation needs no rewards
    assert mix_distill_loss(rl_loss, torch.tensor(float("nan")), 0.0).item() == pytest.approx(rl_loss.item())
    mixed = mix_distill_loss(rl_loss, distill_loss, 0.25)
    assert mixed.item() == pytest.approx(0.75 * rl_loss.item() + 0.25 * distill_loss.item())


def test_mix_gradient_is_the_weighted_sum():
    logp = STUDENT_LOGP.clone().requires_grad_()
    rl = (logp * MASK).sum()  # gradient MASK
    rkl, _ = reverse_kl_pg_loss(logp, TEACHER_LOGP, MASK, agg_mode="seq-mean-token-sum")  # gradient k1 / 2
    mix_distill_loss(rl, rkl, 0.4).backward()
    k1 = torch.tensor([[0.5, -1.0, 0.0], [2.0, -1.0, 0.0]])
    torch.testing.assert_close(logp.grad, 0.6 * MASK + 0.4 * k1 / 2)


# -------------------------------------------------------------------------------------- bad input


def one_line(excinfo):
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_weight_outside_its_range(weight):
    with pytest.raises(ValueError) as err:
        check_distill_weight(weight)
    assert "distill_weight must be in [0, 1]" in one_line(err)
    with pytest.raises(ValueError):
        mix_distill_loss(torch.tensor(1.0), torch.tensor(2.0), weight)


def test_mix_missing_the_loss_it_needs():
    for rl, dist, w in [(None, torch.tensor(1.0), 0.0), (torch.tensor(1.0), None, 1.0), (None, torch.tensor(1.0), 0.5)]:
        with pytest.raises(ValueError) as err:
            mix_distill_loss(rl, dist, w)
        assert "None" in one_line(err)


def test_topk_larger_than_the_vocabulary():
    with pytest.raises(ValueError) as err:
        check_topk(6, 5)
    assert "top-k 6 is larger than the vocabulary (5 tokens)" in one_line(err)
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            check_topk(k, 5)
    student = torch.zeros(2, 3, 5)
    ids = torch.zeros(2, 3, 6, dtype=torch.long)
    with pytest.raises(ValueError) as err:
        topk_forward_kl(student, torch.zeros(2, 3, 6), ids, MASK)
    assert "larger than the vocabulary" in one_line(err)


def test_shape_mismatches():
    with pytest.raises(ValueError) as err:
        reverse_kl_pg_loss(torch.zeros(2, 3), torch.zeros(2, 4), MASK)
    assert "shape mismatch" in one_line(err)
    with pytest.raises(ValueError):
        reverse_kl_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
    student, _, teacher_logp, ids = random_case(0, k=2)
    with pytest.raises(ValueError) as err:
        topk_forward_kl(student, teacher_logp, ids[..., :1], MASK)  # ids and log-probs disagree on k
    assert "shape mismatch" in one_line(err)
    with pytest.raises(ValueError) as err:
        topk_forward_kl(student[:1], teacher_logp, ids, MASK)  # logits for one sequence, top-k for two
    assert "shape mismatch" in one_line(err)
    with pytest.raises(ValueError) as err:
        topk_forward_kl_gathered(teacher_logp, teacher_logp, MASK[:, :2])  # mask (2, 2) vs (2, 3, k)
    assert "shape mismatch" in one_line(err)
    with pytest.raises(ValueError) as err:
        topk_forward_kl_gathered(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0), MASK)
    assert "top-k" in one_line(err)


def test_bad_tail_eps_and_aggregation():
    with pytest.raises(ValueError) as err:
        topk_forward_kl_per_token(torch.zeros(1, 2), torch.zeros(1, 2), tail_eps=0.0)
    assert "tail_eps" in one_line(err)
    with pytest.raises(ValueError) as err:  # ConfigError is a ValueError
        reverse_kl_pg_loss(STUDENT_LOGP, TEACHER_LOGP, MASK, agg_mode="token-mena")
    assert "token-mean" in one_line(err)
