"""Rewards from models (``reward.sources``): mixing by hand, a judge's grades from scripted
replies, a reward model's score against a direct ``AutoModelForSequenceClassification`` forward,
the bad inputs' one lines, a run whose reward mixes a rule, a reward model and a judge, and a
2-rank Ray run with a reward model (slow)."""

import io
import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from fitrl.config import ConfigError, load_config
from fitrl.config.reward_sources import DEFAULT_JUDGE_PATTERN
from fitrl.data.batch import Batch
from fitrl.rewards.mix import parse_grade, standardise, weighted_total
from helpers import EXAMPLE, read_metrics, toy_config


@pytest.fixture(scope="module")
def tiny_reward_model_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-rm", size="tiny", seed=1, head="reward")


def sources(**entries):
    """``reward.sources.<name>.<key>=<value>`` overrides from ``name={key: value}``."""
    return [f"reward.sources.{name}.{k}={v}" for name, kv in entries.items() for k, v in kv.items()]


# ------------------------------------------------------------------------------------- pure parts

def test_weighted_total_by_hand():
    rule, rm = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([2.0, 4.0, 6.0, 8.0])
    total = weighted_total({"rule": rule, "rm": rm}, {"rule": 0.5, "rm": 0.25})
    assert total.tolist() == [1.0, 1.0, 2.0, 2.0]  # 0.5 * rule + 0.25 * rm
    # standardised: rm - 5 over a population std of sqrt(5)
    z = weighted_total({"rule": rule, "rm": rm}, {"rule": 0.5, "rm": 1.0}, {"rm": "batch"})
    s5 = 5 ** 0.5
    assert z.tolist() == pytest.approx([0.5 - 3 / s5, -1 / s5, 0.5 + 1 / s5, 3 / s5])
    assert standardise(torch.tensor([3.0, 3.0])).tolist() == [0.0, 0.0]  # one value: no signal, not 0/0
    with pytest.raises(ValueError, match="weights for"):
        weighted_total({"a": rule}, {"b": 1.0})


@pytest.mark.parametrize("reply, grade", [
    ("Score: 7", 0.7), ("score=10", 1.0), ("The answer is right.\nSCORE: 2.5 (out of 10)", 0.25),
    ("Score: -3", -0.3), ("I would give it 7", None), ("", None), ("Score: 4 then Score: 9", 0.4)])
def test_parse_grade(reply, grade):
    got = parse_grade(reply, DEFAULT_JUDGE_PATTERN, 10.0)
    assert got == (None if grade is None else pytest.approx(grade))


def test_source_config_refusals(tiny_model_dir):
    base = [f"actor.model.path={tiny_model_dir}"]
    cases = [
        (sources(rm={"kind": "model"}), "reward.sources.rm.model.path is empty"),
        (sources(j={"kind": "judge", "model.path": "x", "pattern": "'Score: \\d+'"}), "has no group"),
        (sources(j={"kind": "judge", "model.path": "x", "template": "'Grade {prompt}'"}), "must contain {response}"),
        (sources(j={"kind": "judge", "model.path": "x", "template": "'{response} {reply}'"}), "it has {reply}"),
        (sources(a={"weight": 0}), "every weight is 0"),
        (["reward.sources.bad name.weight=1"], "a source's name is a metric name"),
        (sources(rm={"kind": "model", "model.path": "x", "micro_batch_size": 0}), "micro_batch_size must be >= 1"),
    ]
    for overrides, text in cases:
        with pytest.raises(ConfigError, match=re.escape(text)):
            load_config(EXAMPLE, base + overrides)


# --------------------------------------------------------------------------- the reward model


def test_reward_model_score_equals_a_direct_forward(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    """Micro-batches of right-padded rows of different lengths score as each text alone through
    transformers' own sequence-classification forward (its pooling at the last token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fitrl.roles.model_reward import RewardModelWorker

    cfg = toy_config(tiny_model_dir, tmp_path, *sources(rm={"kind": "model", "model.path": tiny_reward_model_dir,
                                                            "micro_batch_size": 2}))
    worker = RewardModelWorker(cfg, rank=0, world_size=1)
    messages = [[{"role": "user", "content": "What is 1 + 2?"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 + 25?"}],
                [{"role": "user", "content": "Hi"}]]
    responses = ["3", "The answer is 42, since 17 + 25 = 42.", ""]
    got = worker.score(Batch(fields={"prompt_messages": messages, "response_text": responses}))["rm"]

    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    want = []
    for m, r in zip(messages, responses):
        text = tok.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want.append(model(input_ids=ids).logits[0, 0].item())
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in want)) == 3  # three different texts, three different scores


def test_bad_reward_model_directories_get_one_line(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    import shutil

    from fitrl.models.check import ModelDirError
    from fitrl.roles.model_reward import check_reward_sources

    def check(*overrides):
        check_reward_sources(toy_config(tiny_model_dir, tmp_path / "run", *overrides))

    with pytest.raises(ModelDirError, match="reward.sources.rm.model.path"):
        check(*sources(rm={"kind": "model", "model.path": tmp_path / "missing"}))
    with pytest.raises(ConfigError, match=r"is a Qwen2ForCausalLM, not a reward model .* kind: judge"):
        check(*sources(rm={"kind": "model", "model.path": tiny_model_dir}))
    with pytest.raises(ConfigError, match="is a reward model .* use it as kind: model"):
        check(*sources(j={"kind": "judge", "model.path": tiny_reward_model_dir}))
    bare = shutil.copytree(tiny_reward_model_dir, tmp_path / "no-template")
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="its tokenizer has no chat template.*add .chat_template."):
        check(*sources(rm={"kind": "model", "model.path": bare}))


@pytest.mark.cli
def test_missing_reward_model_stops_the_cli_with_one_line(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "fitrl.cli", "train", EXAMPLE, f"actor.model.path={tiny_model_dir}",
           f"trainer.run_dir={tmp_path / 'run'}", "memory.plan=off",
           *sources(rm={"kind": "model", "model.path": tmp_path / "nowhere"})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "reward.sources.rm.model.path" in line]
    assert len(lines) == 1, out.stderr


# ------------------------------------------------------------------------------- judges and mixing


class ScriptedJudges:
    """Stands in for the judge role's handle: each source's replies, in order."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies, self.seen = replies, []

    def judge(self, batch: Batch) -> Batch:
        self.seen.append(batch)
        return Batch(fields={k: v[:len(batch)] for k, v in self.replies.items()})


def test_judge_grades_mixed_with_a_rule_by_hand(caplog):
    from fitrl.config.algorithm import RewardConfig
    from fitrl.config.reward_sources import RewardSourceConfig
    from fitrl.config.roles import ModelConfig
    from fitrl.roles.reward_sources import RewardSources

    cfg = RewardConfig(function="arith", num_workers=0, sources={
        "rule": RewardSourceConfig(kind="function", weight=0.5),
        "judge": RewardSourceConfig(kind="judge", weight=2.0, model=ModelConfig(path="unused"), unparsed_score=-1.0)})
    batch = Batch(fields={"response_text": ["3", "4", "12", "x"], "answer": [3, 3, 12, 7],
                          "source": ["a:1", "a:2", "a:3", "a:4"], "extra": [{}] * 4,
                          "prompt_messages": [[{"role": "user", "content": "What is 1 + 2?"}]] * 4})
    judges = ScriptedJudges({"judge": ["Score: 10", "Score: 5", "no idea", "score = 0"]})
    with RewardSources(cfg) as rewards, caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        rewards.attach(None, judges)
        scored = rewards.score_batch(batch)
    rule = scored.components["rule"].tolist()
    assert scored.components["judge"].tolist() == [1.0, 0.5, -1.0, 0.0]  # "no idea": unparsed_score
    assert scored.scores.tolist() == pytest.approx([0.5 * r + 2.0 * j for r, j in zip(rule, [1.0, 0.5, -1.0, 0.0])])
    assert rule[0] == 1.0 and rule[2] == 1.0  # the arith function's own verdicts: right answers
    assert "exact" in scored.components  # the rule function's components stay
    assert scored.health["reward/judge/unparsed"] == 1.0
    assert "1 of 4 replies do not match" in caplog.text and "'no idea'" in caplog.text
    assert judges.seen[0]["answer"] == [3, 3, 12, 7]  # the judge sees the reference answer


def test_judge_worker_replies_from_a_tiny_model(tiny_model_dir, tmp_path):
    from fitrl.roles.model_reward import JudgeWorker, judge_prompt

    cfg = toy_config(tiny_model_dir, tmp_path, *sources(j={"kind": "judge", "model.path": tiny_model_dir,
                                                           "micro_batch_size": 2, "max_tokens": 4}))
    worker = JudgeWorker(cfg, rank=0, world_size=1)
    msgs = [[{"role": "user", "content": "What is 1 + 2?"}]] * 3
    out = worker.judge(Batch(fields={"prompt_messages": msgs, "response_text": ["3", "4", "three"],
                                     "answer": [3, 3, 3]}))
    assert len(out["j"]) == 3 and all(isinstance(r, str) for r in out["j"])
    text = judge_prompt(cfg.reward.sources["j"], msgs[0], "4", 3)
    assert "Question: What is 1 + 2?" in text and "Response: 4" in text and "Reference answer: 3" in text


# -------------------------------------------------------------------------------------- runs


def test_a_run_mixes_a_rule_a_reward_model_and_a_judge(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    from fitrl.trainer.run import train

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=2", "trainer.val_freq=2",
                     "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "memory.uss_min_phase_s=0",
                     *sources(rule={"weight": 0.5}, rm={"kind": "model", "model.path": tiny_reward_model_dir,
                                                        "weight": 0.25},
                              j={"kind": "judge", "model.path": tiny_model_dir, "max_tokens": 3, "weight": 0.1}))
    train(cfg, Console(file=io.StringIO()))
    steps = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
    assert len(steps) == 2
    for rec in steps:
        parts = 0.5 * rec["reward/rule"] + 0.25 * rec["reward/rm"] + 0.1 * rec["reward/j"]
        assert rec["reward/mean"] == pytest.approx(parts, abs=1e-5)  # means of a weighted sum
        assert rec["reward/j/unparsed"] >= 0 and rec["mem/rank0/reward/host_peak_gib"] > 0
        assert rec["time/reward"] > 0
    assert "val/reward/rm" in [r for r in read_metrics(tmp_path) if "val/reward/mean" in r][-1]


@pytest.mark.slow
def test_ray_run_with_a_reward_model_trains_three_steps(ray_cluster, tiny_model_dir, tiny_reward_model_dir,
                                                        tmp_path):
    """Two policy ranks, two reward-model ranks and two judge ranks (Ray actors of their own,
    FSDP2 over gloo: the judges' ranks reply with different numbers of tokens, on weights
    gathered once); each reward-model rank's measured peak in the reward phase against the plan's."""
    from fitrl.report.load import load_run
    from fitrl.trainer.run import train

    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=3", "trainer.device=cpu", "trainer.backend=ray",
                     "trainer.devices_per_node=2", "data.rollout_batch_size=4", "rollout.n=2",
                     "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.val_before_train=false",
                     "trainer.val_freq=0", "memory.plan=warn", "memory.uss_min_phase_s=0",
                     *sources(rule={"weight": 1.0}, rm={"kind": "model", "model.path": tiny_reward_model_dir,
                                                        "weight": 0.5, "micro_batch_size": 2},
                              j={"kind": "judge", "model.path": tiny_model_dir, "weight": 0.1, "max_tokens": 6}))
    train(cfg, Console(file=io.StringIO()))
    steps = [r for r in read_metrics(tmp_path) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("reward/j" in r and r["mem/judge.rank1/reward/host_peak_gib"] > 0 for r in steps)
    run = load_run(tmp_path)
    for rank in (0, 1):
        measured = steps[-1][f"mem/reward_model.rank{rank}/reward/host_peak_gib"]
        planned = run.plan.peak(f"reward_model.rank{rank}", "reward", "host")
        assert planned is not None
        # the CPU plan's stated band with glibc's default allocator (docs/memory.md, "How accurate it is")
        assert abs(planned - measured) <= 0.2 * measured, (rank, planned, measured)


# ------------------------------------------------------------------------------------- the plan


def test_plan_holds_reward_models_and_judges_on_their_ranks():
    """Qwen2.5-7B as policy, reward model and judge on 8 x 80 GiB under Ray: each model source's
    weights per rank (a reward model without the LM head), on the device only where it scores
    when offloaded, its own forward's transients in the reward phase."""
    from pathlib import Path

    from fitrl.memory import calibration as C
    from fitrl.memory.states import frozen_states
    from fitrl.models.shape import ModelShape
    from fitrl.planner import Hardware, plan_config

    qwen = Path(EXAMPLE).parent / "failure_stories" / "models" / "qwen2.5-7b-instruct"
    bf16 = {"model.dtype": "bfloat16", "model.path": qwen}
    cfg = load_config(EXAMPLE, [f"actor.model.path={qwen}", "trainer.backend=ray", "trainer.devices_per_node=8",
                                "actor.micro_batch_size=4", "reward.num_workers=0",
                                *sources(rule={"weight": 1}, rm={"kind": "model", "fsdp.offload_params": "true", **bf16},
                                         j={"kind": "judge", **bf16})])
    plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * C.GIB, host_memory=2048 * C.GIB))
    shape = ModelShape.from_path(qwen)
    full = frozen_states(shape, 8, "bfloat16").params
    head = shape.vocab * shape.hidden * 2 // 8  # untied: the reward model has a score head instead
    rm, judge = plan.process("reward_model"), plan.process("judge")
    assert rm.phases["reward"].gpu["reward_model params"] == full - head
    assert rm.phases["update"].host["offloaded reward_model params"] == full - head  # offload_params
    assert "reward_model params" not in rm.phases["update"].gpu
    assert judge.phases["update"].gpu["judge params"] == full  # (not offloaded: on the device throughout)
    assert rm.phases["reward"].gpu["activations"] > 0 and "activations" not in rm.phases["update"].gpu
    assert judge.phases["reward"].gpu["kv cache"] > 0
    assert "reward" not in plan_config(load_config(EXAMPLE, [f"actor.model.path={qwen}"]),
                                       Hardware(nodes=1, gpus_per_node=1, gpu_memory=80 * C.GIB)).processes[0].phases


def test_the_report_knows_every_role_of_its_own():
    from fitrl.memory.roles import ROLE_PLANNERS
    from fitrl.report.load import ROLES_OF_THEIR_OWN

    assert set(ROLES_OF_THEIR_OWN) == {p.name for p in ROLE_PLANNERS.in_order() if p.own_process}


def test_the_toy_reward_model_trains_and_reports_its_figures(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from fitrl.models.tiny_reward import train_arith_reward_model

    figures = train_arith_reward_model(tmp_path / "rm", steps=3)
    assert set(figures) >= {"held_out_correlation", "train_right_sum_ranked_first", "mean_score_by_kind"}
    assert json.loads((tmp_path / "rm" / "fitrl_reward_model.json").read_text()) == figures
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_labels == 1
