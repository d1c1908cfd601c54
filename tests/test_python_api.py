"""`fitrl.train(...)`: the Python API a TRL user expects (docs/python-api.md), on the tiny model."""

from __future__ import annotations

import json
import re

import pytest
import yaml

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


# ------------------------------------------------------------------ distillation and MoE, as the CLI runs them

def _short(tmp_path, **more) -> dict:
    return {"trainer.output_dir": str(tmp_path / "runs"), "trainer.max_steps": 1, "data.rollout_batch_size": 4,
            "rollout.n": 2, "actor.mini_batch_size": 4, "rollout.max_response_length": 8, "memory.plan": "warn",
            "trainer.progress_bar": False, "trainer.num_threads": 1, "trainer.val_before_train": False, **more}


ROWS = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(8)]


def _brief(completions, **kwargs):
    return [float(len(c) <= 3) for c in completions]


def test_a_teacher_by_keyword_is_planned_and_scores_the_samples(tiny_model_dir, tmp_path):
    """``teacher_model=`` (TRL's ``DistillationTrainer(teacher_model=...)``) is ``teacher.model.path``:
    the run's pre-flight plan holds the teacher's phase and its steps log the teacher's metrics,
    as ``fitrl train ... teacher.model.path=...`` would."""
    history = fitrl.train(model=str(tiny_model_dir), teacher_model=str(tiny_model_dir), train_dataset=ROWS,
                          reward_funcs=_brief, overrides=_short(tmp_path, **{"algorithm.distill.weight": 0.5,
                                                                             "algorithm.distill.top_k": 2}))
    (step,) = history
    assert step["distill/teacher_logprob"] < 0 and 0 <= step["distill/teacher_agreement"] <= 1
    assert step["time/teacher_logprob"] > 0 and "distill/loss" in step
    run = next((tmp_path / "runs").glob("fitrl-*"))
    assert "teacher_logprob" in json.loads((run / "plan.json").read_text())["phases"]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["teacher"]["model"]["path"] == str(tiny_model_dir) and saved["algorithm"]["distill"]["weight"] == 0.5


def test_a_mixture_of_experts_policy_trains_through_the_api(tmp_path):
    """A MoE policy with routing replay and its load-balancing weight, given as fitrl's keys."""
    from fitrl.models.tiny import make_tiny_model

    moe = make_tiny_model(tmp_path / "tiny-qwen3-moe", arch="qwen3_moe")
    (step,) = fitrl.train(model=str(moe), train_dataset=ROWS, reward_funcs=_brief,
                          overrides=_short(tmp_path, **{"actor.routing_replay": True,
                                                        "actor.router_aux_loss_coef": 0.01}))
    assert step["actor/router_aux_loss"] > 0 and step["moe/routing_mismatch"] == 0.0
    run = next((tmp_path / "runs").glob("fitrl-*"))
    assert json.loads((run / "plan.json").read_text())["phases"]


def test_distillation_mistakes_are_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"teacher_model=.* with algorithm.distill.weight=0 builds no teacher: set "
                                          r"overrides=\{'algorithm.distill.weight': 1.0\}"):
        fitrl.train(model=str(tiny_model_dir), teacher_model=str(tiny_model_dir), overrides=_short(tmp_path))
    with pytest.raises(ConfigError, match=r"teacher_model='.*tiny-qwen2' with .* builds no teacher"):  # TRL's name
        fitrl.train(model=str(tiny_model_dir), teacher_model_name_or_path=str(tiny_model_dir),
                    overrides=_short(tmp_path))
    with pytest.raises(ConfigError, match=r"lmbda=0.5: GKD's fraction .* drop it"):
        fitrl.train(model=str(tiny_model_dir), lmbda=0.5, overrides=_short(tmp_path))
    with pytest.raises(ConfigError, match="name two teachers"):
        fitrl.train(model=str(tiny_model_dir), teacher_model="a", teacher_model_name_or_path="b")
    with pytest.raises(ConfigError, match="unknown argument 'teacher'"):
        fitrl.train(model=str(tiny_model_dir), teacher="a")
