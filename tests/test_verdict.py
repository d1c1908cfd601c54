"""The demo's verdicts (fitrl/trainer/verdict.py) on hand-written metrics: the validation
accuracy's rise judged against the noise of a proportion over the validation prompts, the
reward's against the noise of its per-step means, and the collapses."""

import json

from fitrl.trainer.verdict import accuracy_gain, collapsed, judge_rise


def _metrics(tmp_path, *exact):
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": 50 * i, "val/reward/mean": e, "val/reward/exact": e} for i, e in enumerate(exact)]
    f.write_text("\n".join(json.dumps(r) for r in [*rows, {"step": 7, "reward/mean": 0.5}]))
    return f


def test_a_rise_is_beyond_noise_only_past_two_standard_errors(tmp_path):
    # 0.4 -> 0.8 over 20 prompts: se = sqrt((0.24 + 0.16) / 20) = 0.1414, 2 se = 0.283 < 0.4
    gain = accuracy_gain(_metrics(tmp_path, 0.4, 0.5, 0.8), prompts=20)
    assert gain["beyond_noise"] is True
    assert gain["message"] == ("validation exact-match accuracy: 0.400 at step 0, 0.800 at step 100 (2.00x; "
                               "+0.400, 2 std-errors over 20 prompts = 0.283): GRPO raised it beyond noise")
    # 0.55 -> 0.6: se = sqrt((0.2475 + 0.24) / 20) = 0.156, 2 se = 0.312 > 0.05
    gain = accuracy_gain(_metrics(tmp_path, 0.55, 0.6), prompts=20)
    assert gain["beyond_noise"] is False and gain["message"].endswith("GRPO raised it, but within noise")
    # the same rise over 2000 prompts: 2 se = 0.0312 < 0.05
    assert accuracy_gain(_metrics(tmp_path, 0.55, 0.6), prompts=2000)["beyond_noise"] is True


def test_a_fall_is_said_and_no_count_means_no_judgement(tmp_path):
    gain = accuracy_gain(_metrics(tmp_path, 0.5, 0.45), prompts=20)
    assert gain["beyond_noise"] is False and "(0.90x; -0.050," in gain["message"]
    assert gain["message"].endswith("GRPO did NOT raise it")
    gain = accuracy_gain(_metrics(tmp_path, 0.0, 0.3))
    assert gain["beyond_noise"] is None and gain["message"].endswith("0.300 at step 50: GRPO raised it")
    assert accuracy_gain(_metrics(tmp_path, 0.3)) is None  # one validation: nothing to compare


def test_the_reward_rise_and_the_collapses():
    flat = [0.5, 0.6] * 10
    assert judge_rise(flat)["rose"] is False
    assert judge_rise([0.5, 0.6] * 5 + [0.8, 0.9] * 5)["rose"] is True
    assert judge_rise([0.5] * 5)["judged"] is False
    clipped = [{"response/clip_ratio": 0.95, "response/distinct": 30}] * 10
    assert "ran to the length limit" in collapsed(clipped, 8)
    one = [{"response/clip_ratio": 0.0, "response/distinct": 1.5}] * 10
    assert "1.5 distinct answers" in collapsed(one, 8)
    assert collapsed([{"response/clip_ratio": 0.0, "response/distinct": 20}] * 10, 8) is None
