"""A TRL user's script as it is: reward functions in TRL's documented signatures, a
``datasets.Dataset`` with TRL's columns, TRL's GRPOConfig names (issue 65)."""

from __future__ import annotations

import re

import pytest

import fitrl
from fitrl.config import ConfigError, describe_fields, load_config
from fitrl.config.trl_names import LOSS_TYPES, REFUSED, TRL_KEYS, fitrl_keys, trl_items
from helpers import read_metrics

datasets = pytest.importorskip("datasets")

TINY = {"data.rollout_batch_size": 4, "actor.mini_batch_size": 4, "rollout.max_response_length": 8,
        "trainer.device": "cpu", "memory.plan": "off", "trainer.progress_bar": False}


# --- reward functions as TRL's documentation writes them -------------------------------------------

def accuracy_reward(completions, solution, **kwargs):
    """TRL's docs: the completion against the dataset's ``solution`` column."""
    contents = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if c.strip() == str(s) else 0.0 for c, s in zip(contents, solution)]


def format_reward(completions, **kwargs):
    """TRL's docs, over conversational completions: ``completion[0]["content"]``."""
    pattern = r"^\d+$"
    return [1.0 if re.match(pattern, completion[0]["content"].strip()) else 0.0 for completion in completions]


SEEN: dict[str, list] = {}


def everything(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Every argument TRL documents, recorded for the test to look at."""
    SEEN.setdefault("prompts", []).append(prompts)
    SEEN.setdefault("completions", []).append(completions)
    SEEN.setdefault("completion_ids", []).append(completion_ids)
    SEEN.setdefault("steps", []).append(trainer_state.global_step)
    SEEN.setdefault("kwargs", []).append(sorted(kwargs))
    return [None if i == 0 else float(len(ids)) / 100 for i, ids in enumerate(completion_ids)]


def plain_rows(n=8):
    return [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(n)]


def chat_rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}], "solution": str(i + 2)} for i in range(n)]


def test_trl_functions_train_three_steps_on_conversational_data(tiny_model_dir, tmp_path):
    SEEN.clear()
    dataset = datasets.Dataset.from_list(chat_rows())
    history = fitrl.train(model=str(tiny_model_dir), reward_funcs=[accuracy_reward, format_reward, everything],
                          train_dataset=dataset, num_generations=2, max_steps=3, output_dir=str(tmp_path / "runs"),
                          overrides=TINY)
    assert len(history) == 3
    assert {"reward/accuracy_reward", "reward/format_reward", "reward/everything", "reward/mean"} <= set(history[-1])
    run = next((tmp_path / "runs").glob("fitrl-*"))
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1, 2, 3]
    # TRL's contract: the prompts as the dataset holds them, completions as messages, ids, columns, state
    first = SEEN["prompts"][0]
    assert len(first) == 8 and all(p in [r["prompt"] for r in chat_rows()] for p in first)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in SEEN["completions"][0])
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in SEEN["completion_ids"][0])
    assert SEEN["kwargs"][0] == ["solution"]  # every column but the prompt (and nothing of fitrl's own)
    assert SEEN["steps"] == [0, 1, 2]
    for h in history:  # the weighted sum of the functions (None counted 0)
        parts = h["reward/accuracy_reward"] + h["reward/format_reward"] + h["reward/everything"]
        assert h["reward/mean"] == pytest.approx(parts, abs=1e-6)


def test_a_single_trl_function_on_plain_prompts(tiny_model_dir, tmp_path):
    SEEN.clear()
    history = fitrl.train(model=str(tiny_model_dir), reward_funcs=everything,
                          train_dataset=datasets.Dataset.from_list(plain_rows()),
                          args=fitrl.GRPOConfig(num_generations=2, max_steps=3, learning_rate=1e-5,
                                                output_dir=str(tmp_path / "runs")), overrides=TINY)
    assert len(history) == 3 and "reward/everything" in history[-1]
    assert all(isinstance(p, str) and p.startswith("What is") for p in SEEN["prompts"][0])
    assert all(isinstance(c, str) for c in SEEN["completions"][0])  # plain prompts: completions as text
    cfg = load_config(str(next((tmp_path / "runs").glob("fitrl-*")) / "config.yaml"))
    assert (cfg.rollout.n, cfg.trainer.max_steps, cfg.actor.optim.lr, cfg.data.answer_key) == (2, 3, 1e-5, "")


def test_fitrl_and_trl_signatures_together_need_the_answer_column(tiny_model_dir, tmp_path):
    def exact(response, answer):  # fitrl's own signature: needs data.answer_key's column
        return float(response.strip() == str(answer))

    rows = [{**r, "answer": r["solution"]} for r in plain_rows()]
    history = fitrl.train(model=str(tiny_model_dir), reward_funcs=[exact, accuracy_reward], train_dataset=rows,
                          num_generations=2, max_steps=1, output_dir=str(tmp_path / "runs"), overrides=TINY)
    assert {"reward/exact", "reward/accuracy_reward"} <= set(history[-1])
    with pytest.raises(ConfigError, match=r"^reward function exact\(response, answer\) needs an answer, but "
                                          r"train_dataset has no 'answer' column \(columns: prompt, solution\)"):
        fitrl.train(model=str(tiny_model_dir), reward_funcs=exact, train_dataset=plain_rows(),
                    overrides={"trainer.output_dir": str(tmp_path / "runs2")})


def test_a_column_the_dataset_lacks_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    import fitrl.trainer.run as run

    monkeypatch.setattr(run, "train", lambda cfg: pytest.fail("the run started"))
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}]
    with pytest.raises(ConfigError) as e:
        fitrl.train(model=str(tmp_path), reward_funcs=[format_reward, accuracy_reward], train_dataset=rows,
                    overrides={"trainer.output_dir": str(tmp_path)})
    assert str(e.value) == ("reward function accuracy_reward takes 'solution', but train_dataset has no 'solution' "
                            "column (columns: prompt, answer); rename the column or the parameter")
    with pytest.raises(ConfigError, match=r"^eval_dataset row 0 has no 'prompt' column \(columns: question\)"):
        fitrl.train(model=str(tmp_path), reward_funcs=format_reward, train_dataset=rows,
                    eval_dataset=[{"question": "?"}], overrides={"trainer.output_dir": str(tmp_path)})
    assert not (tmp_path / "datasets").exists()


def test_trl_names_map_to_fitrl_keys_or_are_refused_in_one_line():
    keys = {row[0] for row in describe_fields()}
    for name, fn in TRL_KEYS.items():  # every mapping lands on a key the schema has
        assert {k for k, _ in fn("grpo" if name == "loss_type" else 1)} <= keys, name
    items = trl_items({"num_generations": 8, "max_completion_length": 256, "max_prompt_length": 512,
                       "learning_rate": 1e-6, "per_device_train_batch_size": 4, "beta": 0.04, "epsilon": 0.2,
                       "loss_type": "dr_grpo", "temperature": 0.9, "logging_steps": 5, "seed": 7,
                       "output_dir": "out", "num_train_epochs": 2}, num_rows=10, rollout_batch_size=4)
    assert dict(items) == {"rollout.n": 8, "rollout.max_response_length": 256, "data.max_prompt_length": 512,
                           "actor.optim.lr": 1e-6, "actor.micro_batch_size": 4, "algorithm.use_kl_loss": True,
                           "algorithm.kl_coef": 0.04, "actor.clip_ratio_low": 0.2, "actor.clip_ratio_high": 0.2,
                           "algorithm.loss_agg_mode": "seq-mean-token-sum-norm", "rollout.temperature": 0.9,
                           "trainer.log_freq": 5, "trainer.seed": 7, "trainer.output_dir": "out",
                           "trainer.max_steps": 5}
    assert dict(trl_items({"beta": 0.0}, None, 4)) == {"algorithm.use_kl_loss": False}
    assert dict(trl_items({"num_train_epochs": 3, "max_steps": 2}, 10, 4)) == {"trainer.max_steps": 2}
    with pytest.raises(ConfigError, match="^gradient_accumulation_steps: fitrl derives .* set actor.mini_batch_size$"):
        trl_items({"gradient_accumulation_steps": 4}, None, 4)
    with pytest.raises(ConfigError, match=r"did you mean 'num_generations' \(rollout.n\)\?"):
        fitrl.train(num_generation=4)
    assert set(REFUSED) | set(TRL_KEYS) >= {f.name for f in fitrl.GRPOConfig.__dataclass_fields__.values()} - {
        "num_train_epochs"}


def test_trl_names_given_as_config_keys_point_at_fitrl_keys():
    for key, hint in (("num_generations=4", "TRL's num_generations is rollout.n in fitrl"),
                      ("trainer.learning_rate=1e-6", "TRL's learning_rate is actor.optim.lr in fitrl"),
                      ("max_completion_length=64", "TRL's max_completion_length is rollout.max_response_length")):
        with pytest.raises(ConfigError, match=re.escape(hint)):
            load_config(None, [key])
    assert fitrl_keys("gradient_accumulation_steps").startswith("actor.mini_batch_size")
    assert fitrl_keys("not_a_trl_name") == ""


def test_the_trl_script_in_the_docs_runs_as_written(tiny_model_dir, tmp_path, monkeypatch):
    from helpers import ROOT

    text = (ROOT / "docs" / "python-api.md").read_text()
    block = re.search(r"## A TRL script as it is.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-qwen2").symlink_to(tiny_model_dir)
    scope: dict = {}
    exec(compile(block, "docs/python-api.md", "exec"), scope)
    history = scope["history"]
    assert len(history) == 3 and {"reward/accuracy_reward", "reward/format_reward"} <= set(history[-1])


def test_the_docs_table_lists_every_trl_name_fitrl_reads():
    from helpers import ROOT

    from fitrl.config.trl_names import EPOCHS

    text = (ROOT / "docs" / "python-api.md").read_text()
    table = text[text.index("| TRL | fitrl |"):]
    names = set(TRL_KEYS) | set(REFUSED) | {EPOCHS}
    rows = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]
    listed = {n for row in rows for n in re.findall(r"`(\w+)`", row)}
    assert listed - set(LOSS_TYPES) == names
