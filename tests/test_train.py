"""Integration: the real loop on tiny local models, and the CLI as a user meets it."""

import subprocess
import sys

import pytest
import yaml

from fitrl.trainer.verdict import judge_rise
from fitrl.config import load_config
from helpers import EXAMPLE, ROOT, read_metrics
from helpers import toy_config as config

@pytest.mark.slow
def test_grpo_steps_qwen2(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    history = train(config(tiny_model_dir, run_dir, "trainer.max_steps=3", "rollout.n=4",
                           "actor.mini_batch_size=4", "actor.micro_batch_size=8"))
    assert len(history) == 3
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward/mean" in r]
    vals = [r for r in records if "val/reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in vals] == [0, 3]  # before training and at the end
    for key in ("reward/mean", "response/length_mean", "actor/entropy", "actor/clip_frac", "actor/grad_norm",
                "time/rollout", "time/update", "time/step", "mem/host_rss_gib", "rollout/logprob_diff_mean"):
        assert key in steps[0], key
    # the rollout's log-probs and the actor's recompute see the same fp32 weights
    assert steps[0]["rollout/logprob_diff_mean"] < 1e-3
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved.trainer.max_steps == 3 and saved.rollout.n == 4


@pytest.mark.slow
def test_llama_with_kl_reference(tiny_llama_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(config(tiny_llama_dir, run_dir, "trainer.max_steps=2", "algorithm.use_kl_loss=true",
                 "trainer.val_before_train=false", "data.val_files=[]", "rollout.n=2",
                 "actor.mini_batch_size=4", "actor.micro_batch_size=4"))
    steps = read_metrics(run_dir)
    assert len(steps) == 2 and all("actor/kl_loss" in r and "time/ref" in r for r in steps)
    assert steps[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1


@pytest.mark.slow
def test_val_only(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run_dir = tmp_path / "run"
    train(config(tiny_model_dir, run_dir, "trainer.val_only=true"))
    records = read_metrics(run_dir)
    assert len(records) == 1 and records[0]["step"] == 0 and "val/reward/mean" in records[0]


@pytest.mark.slow
def test_toy_task_reward_rises(tiny_model_dir, tmp_path):
    """The demo's promise at a smaller scale: 40 steps of GRPO raise the reward beyond noise."""
    from fitrl.trainer.run import train

    history = train(config(tiny_model_dir, tmp_path / "run", "trainer.max_steps=40",
                           "trainer.val_before_train=false", "data.val_files=[]"))
    verdict = judge_rise([h["reward/mean"] for h in history])
    assert verdict["rose"], verdict["message"]


def test_judge_rise():
    assert judge_rise([0.0, 0.1] * 5 + [0.5, 0.6] * 5)["rose"]
    assert not judge_rise([0.0, 0.5] * 10)["rose"]
    assert not judge_rise([0.1] * 5)["rose"]


def test_a_collapsed_policy_is_called_that():
    """The demo's verdict: a rise to responses that all run to the length limit, or to one
    constant answer, is not learning (fitrl/trainer/verdict.py, ``collapsed``)."""
    from fitrl.trainer.verdict import collapsed

    healthy = [{"response/clip_ratio": 0.1, "response/distinct": 20.0}] * 10
    assert collapsed(healthy, 8) is None and collapsed(healthy[:5], 8) is None  # too few steps to judge
    at_limit = [{"response/clip_ratio": 1.0, "response/distinct": 30.0}] * 10
    assert collapsed(at_limit, 8) == ("100% of the last 10 steps' responses ran to the length limit "
                                      "(rollout.max_response_length=8) without ending")
    constant = [{"response/clip_ratio": 0.0, "response/distinct": 1.0}] * 10
    assert collapsed(constant, 8) == "the last 10 steps' responses are 1.0 distinct answers on average"


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "fitrl.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("override,expected", [
    ("actor.optim.lrr=1e-5", "did you mean 'actor.optim.lr'?"),
    ("trainer.max_steps=abc", "'trainer.max_steps' (in overrides) expects int, got str 'abc'"),
    ("actor.mini_batch_size=3", "actor.mini_batch_size"),
])
def test_cli_config_errors_are_one_line_exit_2(override, expected):
    proc = run_cli("train", "examples/arith.yaml", override)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_yaml_typo_names_file_and_nearest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"base": EXAMPLE, "rollout": {"temprature": 0.5}}))
    proc = run_cli("train", str(bad))
    assert proc.returncode == 2 and "did you mean 'rollout.temperature'?" in proc.stderr


def test_cli_help_lists_subcommands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for sub in ("train", "demo", "make-tiny-model", "export", "config"):
        assert sub in proc.stdout


@pytest.mark.slow
def test_cli_train_end_to_end(tmp_path):
    model = tmp_path / "m"
    assert run_cli("make-tiny-model", str(model), "--arch", "llama").returncode == 0
    proc = run_cli("train", "examples/arith.yaml", f"actor.model.path={model}", f"trainer.run_dir={tmp_path / 'r'}",
                   "trainer.max_steps=2", "trainer.val_before_train=false")
    assert proc.returncode == 0, proc.stderr
    assert "step    2 | reward" in proc.stdout and "metrics:" in proc.stdout
