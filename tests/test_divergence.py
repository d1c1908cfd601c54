"""Divergence detection on hand-made step metrics (fitrl/trainer/divergence.py), the workers'
finiteness checks (weights after an update, logits during generation), and the decision to
write an emergency checkpoint on a signal (fitrl/trainer/signals.py)."""

from __future__ import annotations

import math

import pytest
import torch

from fitrl.config.run import DivergenceConfig
from fitrl.core.errors import ConfigError, Diverged
from fitrl.trainer.divergence import DivergenceJudge, vocab_size
from fitrl.trainer.signals import why_not_save

V = 512
LOG_V = math.log(V)
HEALTHY = {"reward/mean": 0.3, "advantage/mean": 0.0, "advantage/max": 1.4, "advantage/min": -1.1,
           "actor/pg_loss": 0.01, "actor/entropy": 2.5, "actor/grad_norm": 0.7, "actor/weights_nonfinite": 0.0}


def step(**changes) -> dict:
    return {**HEALTHY, **changes}


def judge(**cfg) -> DivergenceJudge:
    return DivergenceJudge(DivergenceConfig(**cfg), vocab_size=V)


def test_a_healthy_step_is_no_divergence():
    j = judge()
    assert all(j.observe(step()) is None for _ in range(10)) and j.pending is None


@pytest.mark.parametrize("key, text", [
    ("actor/pg_loss", "the policy loss is nan"),
    ("actor/grad_norm", "every optimizer step of this RL step had a non-finite gradient"),
    ("actor/entropy", "the policy's entropy is nan"),
    ("critic/vf_loss", "the critic's loss is nan"),
    ("actor/kl_loss", "the KL loss is nan"),
])
def test_a_non_finite_value_stops_at_once(key, text):
    assert text in judge().observe(step(**{key: math.nan}))


def test_the_first_cause_is_named():
    # an infinite reward makes the advantages and the loss NaN too: the reward is named
    reason = judge().observe(step(**{"reward/mean": math.inf, "advantage/mean": math.nan, "actor/pg_loss": math.nan}))
    assert reason.startswith("the mean reward is inf")


def test_non_finite_weights_stop_at_once():
    assert "2 trained weight tensor(s) hold NaN or infinity" in judge().observe(step(**{"actor/weights_nonfinite": 2.0}))


def test_a_saturated_policy_stops_after_patience_steps():
    j = judge(patience=3)
    dead = step(**{"actor/entropy": LOG_V, "actor/grad_norm": 0.0})
    assert j.observe(dead) is None and "step 1 of trainer.divergence.patience=3" in j.pending
    assert j.observe(dead) is None and "step 2 of" in j.pending
    reason = j.observe(dead)
    assert "the policy is saturated" in reason and "100.0% of log(vocabulary 512)" in reason
    assert reason.endswith("for 3 consecutive steps") and j.steps_since_onset == 3


def test_a_random_initialised_model_is_not_saturated():
    # it also sits at log(vocabulary), but it gets gradients
    j = judge(patience=1)
    assert j.observe(step(**{"actor/entropy": 0.999 * LOG_V, "actor/grad_norm": 0.4})) is None


def test_zero_gradient_with_zero_advantages_is_not_saturation():
    # every group's rewards equal (e.g. all 0 at the start of a hard task): no signal, no gradient
    j = judge(patience=1)
    flat = step(**{"actor/entropy": LOG_V, "actor/grad_norm": 0.0, "advantage/max": 0.0, "advantage/min": 0.0})
    assert j.observe(flat) is None and j.pending is None


def test_saturation_is_not_judged_without_a_vocabulary_size():
    j = DivergenceJudge(DivergenceConfig(patience=1), vocab_size=None)
    assert j.observe(step(**{"actor/entropy": LOG_V, "actor/grad_norm": 0.0})) is None


def test_a_collapsed_policy_stops_after_patience_steps():
    j = judge(patience=2)
    collapsed = step(**{"actor/entropy": 1e-7, "actor/grad_norm": 0.0, "advantage/max": 0.0, "advantage/min": 0.0})
    assert j.observe(collapsed) is None
    assert "the policy has collapsed: entropy 1.0e-07" in j.observe(collapsed)


def test_a_low_entropy_that_still_learns_is_no_collapse():
    j = judge(patience=1)
    assert j.observe(step(**{"actor/entropy": 1e-7, "actor/grad_norm": 0.05})) is None


def test_a_gap_resets_the_count():
    j = judge(patience=2)
    dead = step(**{"actor/entropy": LOG_V, "actor/grad_norm": 0.0})
    assert j.observe(dead) is None
    assert j.observe(step()) is None and j.pending is None
    assert j.observe(dead) is None  # 1 of 2 again
    assert j.observe(dead) is not None


def test_kl_blow_up_in_the_loss_and_in_the_reward():
    j = judge(patience=1, max_kl=10.0)
    assert "the KL to the reference is 25 nats/token" in j.observe(step(**{"actor/kl_loss": 25.0}))
    # in the reward it is per response: 600 nats over 40 tokens = 15 per token
    j = judge(patience=1, max_kl=10.0)
    assert "15 nats/token" in j.observe(step(**{"kl_in_reward/kl": 600.0, "response/length_mean": 40.0}))
    assert judge(patience=1, max_kl=0.0).observe(step(**{"actor/kl_loss": 1e6})) is None  # 0 disables


def test_reward_blow_up():
    j = judge(patience=2, max_abs_reward=100.0)
    assert j.observe(step(**{"reward/mean": -1e5})) is None
    assert "the mean reward is -1e+05" in j.observe(step(**{"reward/mean": -1e5}))


def test_disabled_judges_nothing():
    assert judge(enable=False).observe(step(**{"actor/pg_loss": math.nan})) is None


@pytest.mark.parametrize("bad", [{"patience": 0}, {"uniform_entropy_fraction": 1.5}, {"max_kl": -1.0},
                                 {"min_entropy": math.nan}])
def test_bad_settings_are_config_errors(bad):
    with pytest.raises(ConfigError, match="trainer.divergence"):
        DivergenceConfig(**bad)


def test_vocab_size_from_config_json(tmp_path):
    """Read through the model's one description (fitrl/models/shape.py), any dense model type."""
    import json

    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **text, "vocab_size": 512}))
    assert vocab_size(str(tmp_path)) == 512
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64}, "text_config": {**text, "vocab_size": 151936},
        "vocab_size": None}))
    assert vocab_size(str(tmp_path)) == 151936
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", **text, "vocab_size": 320}))
    assert vocab_size(str(tmp_path)) == 320
    (tmp_path / "config.json").write_text("{")
    assert vocab_size(str(tmp_path)) is None
    assert vocab_size(str(tmp_path / "nowhere")) is None


# ----------------------------------------------------------------------------- in the workers


def test_nonfinite_weights_counts_trained_tensors_only():
    from fitrl.roles.actor import nonfinite_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert nonfinite_weights(model, torch.device("cpu")) == 0.0
    with torch.no_grad():
        model[0].weight[1, 2] = math.nan
        model[1].bias[0] = -math.inf
    assert nonfinite_weights(model, torch.device("cpu")) == 2.0
    model[1].requires_grad_(False)  # frozen: not the update's doing
    assert nonfinite_weights(model, torch.device("cpu")) == 1.0


def test_generation_with_non_finite_logits_raises_diverged_without_crashing_the_sampler():
    from fitrl.config.schema import SamplingConfig
    from fitrl.rollout.hf import SampleAndRecord

    recorder = SampleAndRecord(SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, n=1, max_tokens=4))
    scores = torch.zeros(2, 8)
    scores[0, 3] = math.nan
    scores[1, 5] = math.inf
    out = recorder(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.isfinite(torch.softmax(out, -1)).all()  # what the sampler gets is finite
    with pytest.raises(Diverged, match="logits hold NaN or infinity"):
        recorder.finish(torch.zeros(2, dtype=torch.long), 1)


# ----------------------------------------------------------------------------- on a signal


def plan(**changes):
    args = dict(done=5, start_step=0, checkpointed=False, elapsed=1.0, expected_save_s=2.0, grace_s=25.0,
                divergence=None)
    return why_not_save(**{**args, **changes})


def test_an_emergency_checkpoint_is_written_when_there_is_time():
    assert plan() is None
    assert plan(expected_save_s=None) is None  # no save measured yet: try (saves are atomic)


@pytest.mark.parametrize("changes, why", [
    ({"checkpointed": True}, "step 5 is checkpointed already"),
    ({"done": 0}, "nothing was trained since the start"),
    ({"done": 4, "start_step": 4}, "nothing was trained since the resume at step 4"),
    ({"divergence": "entropy ..."}, "divergence suspected"),
    ({"grace_s": 0.0}, "trainer.signal_grace_s=0"),
    ({"elapsed": 20.0, "expected_save_s": 10.0}, "it would end ~30 s after the signal"),
])
def test_why_no_emergency_checkpoint(changes, why):
    assert why in plan(**changes)
