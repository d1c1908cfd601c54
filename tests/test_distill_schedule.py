"""When and where the teacher's term applies (issue 64): distill, then RL
(``algorithm.distill.decay_steps``: the weight's linear fall, its bad values, and a run whose
teacher trains the first steps and is then skipped, RL alone), and reward-guided masking
(``algorithm.distill.solved_score``: solved responses left to the RL term).

The teacher is the student's own tiny model (the same tokenizer by construction): what is checked
is which steps mix which losses and run which phases, not what is learned.
"""

from __future__ import annotations

import pytest
from helpers import read_metrics, toy_config

from fitrl.config.algorithm import DistillConfig
from fitrl.core.errors import ConfigError

SMALL = ["data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=4", "actor.micro_batch_size=8",
         "trainer.val_before_train=false", "reward.num_workers=0", "trainer.num_threads=1", "trainer.val_freq=0",
         "data.val_files=[]"]


def test_the_weight_falls_linearly_to_zero_and_stays_there():
    d = DistillConfig(weight=0.8, loss="reverse_kl", decay_steps=4)
    assert [d.weight_at(s) for s in range(1, 8)] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0])
    assert [DistillConfig(weight=0.5).weight_at(s) for s in (1, 100)] == [0.5, 0.5]  # 0: constant


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_decay_is_one_config_error(bad):
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.decay_steps must be an integer >= 0"):
        DistillConfig(weight=0.5, decay_steps=bad)


def test_distill_then_rl_runs_the_teacher_only_while_its_weight_is_above_zero(tiny_model_dir, tmp_path):
    """Weight 1 falling over 2 steps: step 1 pure distillation, step 2 half of each, steps 3 and 4
    GRPO alone, with no teacher pass (its phase is not timed) and no distillation loss."""
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    cfg = toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=4", "algorithm.distill.weight=1",
                     "algorithm.distill.decay_steps=2", "algorithm.distill.loss=topk_forward_kl",
                     "algorithm.distill.top_k=4", f"teacher.model.path={tiny_model_dir}")
    train(cfg)
    records = [r for r in read_metrics(run) if "actor/grad_norm" in r]
    assert [r["distill/weight"] for r in records] == [1.0, 0.5, 0.0, 0.0]
    for r in records[:2]:
        assert r["time/teacher_logprob"] > 0 and "distill/loss" in r and "distill/teacher_agreement" in r
    for r in records[2:]:
        assert not any(k.startswith(("distill/loss", "distill/teacher", "time/teacher")) for k in r), sorted(r)
        assert r["actor/grad_norm"] > 0  # the policy loss still trains


def test_solved_responses_are_left_to_the_rl_term():
    """``solved_score``: a response the reward accepts adds nothing to the distillation loss, whose
    token mean still runs over the whole mini-batch (the solved tokens count, at 0)."""
    import torch

    from fitrl.algo.distill import topk_forward_kl_gathered
    from fitrl.algo.losses import Denominators
    from fitrl.config.algorithm import AlgorithmConfig
    from fitrl.data.batch import Batch
    from fitrl.roles.distill import DistillTerm

    g = torch.Generator().manual_seed(0)
    B, R, k = 3, 4, 2
    teacher = torch.log_softmax(torch.randn(B, R, k + 1, generator=g), -1)[..., :k]
    student = torch.log_softmax(torch.randn(B, R, k + 1, generator=g), -1)[..., :k]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    micro = Batch(tensors={"teacher_logprobs": teacher[..., 0], "teacher_topk_logprobs": teacher,
                           "scores": torch.tensor([1.0, 0.4, 0.0])})
    denom = Denominators(tokens=float(mask.sum()), sequences=B, max_response_length=R)

    def term(solved):
        algo = AlgorithmConfig(distill=DistillConfig(weight=0.5, loss="topk_forward_kl", top_k=k, solved_score=solved))
        return DistillTerm(algo, policy_loss=None).loss(micro, teacher[..., 0], teacher[..., 0], student, mask, denom,
                                                         on_policy=True)

    (gated, m), (every, _) = term(1.0), term(None)
    unsolved = mask * torch.tensor([0.0, 1.0, 1.0])[:, None]
    expected, _ = topk_forward_kl_gathered(student, teacher, unsolved, denom=denom)
    assert torch.allclose(gated, expected) and float(m["distill/distilled_fraction"]) == pytest.approx(2 / 3)
    assert float(gated) < float(every)  # the solved row's KL is gone, the denominator is the same
