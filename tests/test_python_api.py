"""`fitrl.train(...)`: the Python API a TRL user expects (docs/python-api.md), on the tiny model."""

from __future__ import annotations

import re

import pytest

import fitrl
from fitrl.config import ConfigError
from fitrl.rewards.functions import check_reward_spec
from fitrl.rewards.python import register_python_rewards
from helpers import ROOT, read_metrics


def quick_start() -> str:
    text = (ROOT / "docs" / "python-api.md").read_text()
    return re.search(r"## Quick start.*?```python\n(.*?)```", text, re.S).group(1)


def test_the_quick_start_runs_as_written(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-qwen2").symlink_to(tiny_model_dir)
    scope: dict = {}
    exec(compile(quick_start(), "docs/python-api.md", "exec"), scope)
    history = scope["history"]
    assert len(history) == 3 and {"reward/exact", "reward/brief", "reward/mean"} <= set(history[-1])
    for h in history:  # the reward is the weighted sum of the functions' components
        assert h["reward/mean"] == pytest.approx(h["reward/exact"] + 0.1 * h["reward/brief"], abs=1e-6)
    run = next((tmp_path / "runs").glob("fitrl-*"))
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1, 2, 3]
    assert len(list((tmp_path / "runs" / "datasets").glob("train-*.jsonl"))) == 1


def test_trl_and_fitrl_signatures_and_weights():
    def trl(completions, solution, **kwargs):  # a column named by the function
        return [float(c == s) for c, s in zip(completions, solution)]

    def plain(response, answer):
        return {"score": 0.5}

    fn = check_and_resolve(register_python_rewards([trl, plain], [2.0, 1.0], answer_key="solution"))
    out = fn(["7", "8"], ["7", "9"], extras=[{}, {}])
    assert out == [{"score": 2.5, "trl": 1.0, "plain": 0.5}, {"score": 0.5, "trl": 0.0, "plain": 0.5}]


def check_and_resolve(name):
    from fitrl.rewards.functions import resolve_reward_fn

    check_reward_spec(name)
    return resolve_reward_fn(name)


def test_mistakes_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="non-empty list of callables"):
        register_python_rewards([])
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        register_python_rewards([len], [1, 2])
    with pytest.raises(ConfigError, match="names Python callables given to fitrl.train"):
        check_reward_spec("python:gone")
    with pytest.raises(ConfigError, match="not JSON data"):
        fitrl.train(model=str(tmp_path), train_dataset=[{"prompt": object()}],
                    overrides={"trainer.output_dir": str(tmp_path)})


def test_a_reward_model_path_among_the_reward_funcs(tiny_model_dir, tmp_path):
    from fitrl.models.tiny import make_tiny_model

    rm = make_tiny_model(tmp_path / "rm", seed=3, head="reward")

    def brief(completions, **kwargs):
        return [float(len(c) <= 3) for c in completions]

    history = fitrl.train(model=str(tiny_model_dir), train_dataset=[{"prompt": f"What is {i} + 1?", "answer": i + 1}
                                                                     for i in range(8)],
                          reward_funcs=[brief, str(rm)], reward_weights=[0.5, 2.0],
                          overrides={"trainer.output_dir": str(tmp_path / "runs"), "trainer.max_steps": 2,
                                     "data.rollout_batch_size": 4, "rollout.n": 2, "actor.mini_batch_size": 4,
                                     "memory.plan": "off", "trainer.progress_bar": False})
    for h in history:  # 0.5 x brief (inside the functions' source) + 2 x the reward model's score
        assert h["reward/mean"] == pytest.approx(h["reward/functions"] + 2.0 * h["reward/rm"], abs=1e-5)
        assert h["reward/functions"] == pytest.approx(0.5 * h["reward/brief"], abs=1e-6)
    with pytest.raises(ConfigError, match="1 weights for 2 reward functions"):
        fitrl.train(model=str(tiny_model_dir), reward_funcs=[brief, str(rm)], reward_weights=[1.0])
