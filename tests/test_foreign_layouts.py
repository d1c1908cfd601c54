"""Datasets as veRL and EasyR1 write them load without a conversion step: nested answer keys
(``reward_model.ground_truth``), prompts as chat messages, ``data_source`` routing the reward
(``reward.function=by_source``)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fitrl.core.errors import DataError
from fitrl.data.rows import MISSING, lookup, missing_key_text
from fitrl.rewards.by_source import by_source_reward, route
from helpers import DATA, read_metrics, toy_config


def verl_rows(path):
    """The arithmetic toy set in veRL's layout (its examples/data_preprocess/gsm8k.py writes the
    same columns): a chat-message prompt, the answer under reward_model, the source, extra_info."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line)
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": r["prompt"]}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
                     "extra_info": {"split": "train", "index": i}})
    return rows


def write_parquet(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_nested_keys_reach_into_objects():
    row = {"reward_model": {"ground_truth": "8", "style": "rule"}, "a.b": 1, "extra_info": {"index": 3}}
    assert lookup(row, "reward_model.ground_truth") == "8"
    assert lookup(row, "a.b") == 1  # a column with that exact name wins
    assert lookup(row, "extra_info.split") is MISSING and lookup(row, "nope") is MISSING
    assert missing_key_text(row, "reward_model.answer") == "'reward_model' has keys: ground_truth, style"
    assert missing_key_text(row, "reward_model.ground_truth.x") == "'reward_model.ground_truth' is a string, not an object"


def test_by_source_routes_each_row_to_its_rule():
    assert route("openai/gsm8k") == "math" and route("hiyouga/geometry3k") == "r1v" and route("x") == "math"
    assert by_source_reward("so #### 72", "72", extra={"data_source": "openai/gsm8k"})["accuracy"] == 1.0
    assert by_source_reward("<think>a</think><answer>(C)</answer>", "C",
                            extra={"data_source": "hiyouga/geometry3k"})["score"] == 1.0
    assert by_source_reward("8", "8", extra={"data_source": "arith"})["exact"] == 1.0
    assert by_source_reward("8", "8", extra={"src": "arith"}, source_key="src", routes=[["ar", "arith"]])["exact"] == 1.0


def test_a_missing_nested_answer_names_what_the_row_has(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    train_file = write_parquet(verl_rows(DATA / "arith_train.jsonl")[:8], tmp_path / "train.parquet")
    cfg = toy_config(tiny_model_dir, tmp_path / "run", f"data.train_files=[{train_file}]", "data.val_files=[]",
                     "data.answer_key=reward_model.answer")
    with pytest.raises(DataError, match=r"row 0: row has no 'reward_model.answer' column \('reward_model' has keys: "
                                         r"style, ground_truth\); set data.answer_key"):
        train(cfg)


@pytest.mark.slow
def test_a_verl_layout_parquet_trains_as_it_is(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    train_file = write_parquet(verl_rows(DATA / "arith_train.jsonl"), tmp_path / "train.parquet")
    val_file = write_parquet(verl_rows(DATA / "arith_val.jsonl"), tmp_path / "test.parquet")
    run_dir = tmp_path / "run"
    history = train(toy_config(tiny_model_dir, run_dir, f"data.train_files=[{train_file}]",
                               f"data.val_files=[{val_file}]", "data.answer_key=reward_model.ground_truth",
                               "reward.function=by_source", "trainer.max_steps=3", "rollout.n=4",
                               "actor.mini_batch_size=4", "trainer.log_samples=2", "trainer.log_samples_freq=1"))
    assert len(history) == 3
    records = read_metrics(run_dir)
    steps = [r for r in records if "reward/mean" in r]
    # the arithmetic rule scored every step (its components), routed by the rows' data_source
    assert all({"reward/digits", "reward/closeness", "reward/exact"} <= set(r) for r in steps)
    assert any("val/by_source/arith/reward/mean" in r for r in records)
    sample = json.loads((run_dir / "generations.jsonl").read_text().splitlines()[0])
    assert sample["source"] == "arith" and sample["answer"] in {str(i) for i in range(40)}
