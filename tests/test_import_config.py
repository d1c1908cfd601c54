"""`fitrl import-config`: real veRL and EasyR1 launch scripts and configs (tests/data/foreign/,
each headed by its repository, path and commit) become fitrl configs that load and plan, with a
line per key saying whether it was translated, approximated or not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
from fitrl.cli import main
from fitrl.config import ConfigError, load_config
from fitrl.config.importer import import_config
from fitrl.planner import Hardware, plan_config
from helpers import ROOT

FOREIGN = ROOT / "tests" / "data" / "foreign"
MODELS = yaml.safe_load((ROOT / "bench" / "field_corpus" / "models.yaml").read_text())
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}  # Qwen/Qwen3-4B's config.json (4.02B)
CASES = [  # (source, the shape of the model it names)
    ("verl/run_qwen2-7b.sh", "qwen2-7b-instruct"),
    ("verl/run_qwen2_5_vl-7b.sh", "qwen2.5-vl-7b-instruct"),
    ("verl/run_qwen2_5-3b_gsm8k_grpo_lora.sh", "qwen2.5-3b-instruct"),
    ("verl/run_qwen2-7b_math_rf.sh", "qwen2-7b-instruct"),
    ("verl/run_qwen2-7b_seq_balance.sh", "qwen2-7b-instruct"),
    ("easyr1/examples/config.yaml", "qwen2.5-7b-instruct"),
    ("easyr1/examples/qwen2_5_7b_math_grpo.sh", "qwen2.5-7b-instruct"),
    ("easyr1/examples/qwen2_5_vl_7b_geo3k_grpo.sh", "qwen2.5-vl-7b-instruct"),
    ("easyr1/examples/qwen3_4b_math_grpo_lora.sh", "qwen3-4b"),
]


def model_dir(name: str, root: Path) -> Path:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(QWEN3_4B if name == "qwen3-4b" else MODELS[name]["config"]))
    return d


def lines(imported) -> dict[str, tuple[str, str]]:
    return {key.split("=")[0]: (status, text) for status, key, text in imported.lines}


def test_a_verl_launch_script():
    imp = import_config(str(FOREIGN / "verl/run_qwen2-7b.sh"))
    c = imp.config
    assert imp.format == "verl"
    assert (c["data.rollout_batch_size"], c["rollout.n"], c["actor.mini_batch_size"], c["actor.micro_batch_size"]) == \
        (1024, 5, 256, 40)
    assert (c["algorithm.adv_estimator"], c["algorithm.use_kl_loss"], c["algorithm.kl_estimator"]) == \
        ("grpo", True, "low_var_kl")
    assert c["algorithm.kl_coef"] == 0.001 and c["actor.optim.lr"] == 1e-6  # 1e-6: a number, as Hydra reads it
    assert (c["rollout.engine"], c["rollout.tensor_parallel_size"], c["trainer.backend"]) == ("vllm", 2, "ray")
    assert c["data.answer_key"] == "reward_model.ground_truth" and c["reward.function"] == "by_source"
    assert c["trainer.loggers"] == ["console", "wandb"] and c["trainer.val_freq"] == 5
    seen = lines(imp)
    assert seen["trainer.total_epochs"][0] == "not translated" and "trainer.max_steps" in seen["trainer.total_epochs"][1]
    # a Hub id is kept as the source names it (docs/hub.md): read through the Hugging Face cache
    assert seen["actor_rollout_ref.model.path"][0] == "translated" and "is a Hub id" in seen["actor_rollout_ref.model.path"][1]
    assert c["actor.model.path"] == "Qwen/Qwen2-7B-Instruct"


def test_a_verl_script_with_list_variables_and_a_critic():
    imp = import_config(str(FOREIGN / "verl/run_qwen2-7b_math_rf.sh"))
    assert len(imp.config["data.train_files"]) == 2 and imp.config["data.train_files"][0].endswith("gsm8k/train.parquet")
    assert imp.config["algorithm.adv_estimator"] == "reinforce_plus_plus"
    ppo = import_config(str(FOREIGN / "verl/run_qwen2-7b_seq_balance.sh"))
    assert ppo.config["algorithm.adv_estimator"] == "gae" and ppo.config["critic.model.path"] == "Qwen/Qwen2-7B-Instruct"
    assert ppo.config["actor.micro_batch_token_budget"] == 24000
    mode = lines(ppo)["actor_rollout_ref.rollout.mode"]  # veRL's async is a server for generation, on-policy
    assert mode[0] == "translated" and mode[1].startswith("rollout.mode=sync") and "docs/async.md" in mode[1]


def test_padding_free_and_ulysses_keys_translate():
    verl = import_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_remove_padding=True",
                                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]).config
    assert (verl["actor.packing"], verl["actor.ulysses_size"]) == (True, 2)
    off = import_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.model.use_remove_padding=False"])
    assert off.config["actor.packing"] is False
    easyr1 = import_config(str(FOREIGN / "easyr1/examples/config.yaml")).config
    assert easyr1["actor.ulysses_size"] == 1


def test_a_verl_command_line_and_its_defaults():
    imp = import_config(None, ["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
                               "actor_rollout_ref.rollout.n=8", "+trainer.unknown_key=3"])
    assert imp.config["data.rollout_batch_size"] == 1024  # veRL's default, not fitrl's
    assert "(veRL's default)" in next(k for _, k, _ in imp.lines if k.startswith("data.train_batch_size"))
    assert lines(imp)["trainer.unknown_key"] == ("not translated", "no fitrl key for it")


def test_an_easyr1_config_and_script():
    imp = import_config(str(FOREIGN / "easyr1/examples/qwen2_5_vl_7b_geo3k_grpo.sh"))
    c = imp.config
    assert imp.format == "easyr1"
    assert (c["data.rollout_batch_size"], c["actor.mini_batch_size"], c["actor.micro_batch_size"]) == (512, 128, 1)
    assert c["actor.logprob_micro_batch_size"] == c["ref.logprob_micro_batch_size"] == 2
    assert c["actor.model.path"] == "Qwen/Qwen2.5-VL-7B-Instruct"  # the script's variable, filled in
    assert c["data.train_files"] == ["hiyouga/geometry3k@train"] and c["trainer.experiment_name"] == "qwen2_5_vl_7b_geo_grpo"
    assert (c["algorithm.kl_estimator"], c["algorithm.kl_coef"], c["rollout.val.temperature"]) == ("low_var_kl", 0.01, 0.6)
    assert c["reward.function"] == "math"  # EasyR1's math.py: the built-in that scores the same answers
    assert c["data.prompt_template"].startswith("{{ problem | trim }} You FIRST think")  # its math.jinja
    assert (c["actor.fsdp.offload_params"], c["ref.fsdp.cpu_offload"], c["checkpoint.save_limit"]) == (True, True, 3)
    assert lines(imp)["data.train_files"][0] == "translated"  # a Hub dataset, kept: read through the cache
    assert "is a Hub id" in lines(imp)["data.train_files"][1]
    lora = import_config(str(FOREIGN / "easyr1/examples/qwen3_4b_math_grpo_lora.sh")).config
    assert (lora["actor.lora.rank"], lora["actor.lora.alpha"], lora["trainer.devices_per_node"]) == (64, 64, 1)


@pytest.mark.parametrize("source,model", CASES, ids=[c[0] for c in CASES])
def test_every_real_config_imports_loads_and_plans(source, model, tmp_path):
    out = tmp_path / "imported.yaml"
    assert main(["import-config", str(FOREIGN / source), "-o", str(out)]) == 0
    d = model_dir(model, tmp_path)
    cfg = load_config(str(out), [f"actor.model.path={d}"] + ([f"critic.model.path={d}"] if "critic:" in out.read_text()
                                                              and "  model:" in out.read_text() else []))
    plan = plan_config(cfg, Hardware.for_config(cfg))
    assert plan.verdict in ("fits", "tight", "does not fit") and plan.peaks()


def test_mistakes_are_one_line(tmp_path, capsys):
    assert main(["import-config", str(tmp_path / "missing.sh")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "x.sh").write_text("echo hello\n")
    assert main(["import-config", str(tmp_path / "x.sh")]) == 2
    assert "no `python3 -m verl.trainer.main_ppo`" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot tell the source's framework"):
        import_config(None, ["model.path=/m"])


def test_the_switching_tables_name_real_keys():
    """docs/switching.md: each veRL/EasyR1 key is one the importer maps, each fitrl key one the schema has."""
    from fitrl.config.import_maps import EASYR1, SPECIAL, VERL
    from fitrl.config.loader import describe_fields

    schema = {row[0] for row in describe_fields()}
    roots = {k.split(".")[0] for k in schema}
    text = (ROOT / "docs" / "switching.md").read_text()
    for title, source in (("veRL (", VERL), ("EasyR1 (", EASYR1)):
        table = text.split(title, 1)[1].split("\n\n", 2)[1]
        for row in table.splitlines()[2:]:
            left, right = row.split("|")[1:3]
            keys = re.findall(r"`([\w.]+)`", left.split("(")[0])
            for key in keys:  # "`a.b.c`, `d`": d is c's sibling
                full = key if "." in key else keys[0].rsplit(".", 1)[0] + "." + key
                assert full in source or full in SPECIAL, f"{title} {full}"
            for key in re.findall(r"`([\w.]+)", right):
                key = key.rstrip(".")  # (`a.b.*`: the section)
                if "." in key and key.split(".")[0] in roots:
                    assert key in schema or any(k.startswith(key + ".") for k in schema), f"{title} fitrl key {key}"


def test_a_verl_reward_model_becomes_a_reward_source():
    imp = import_config(None, ["reward_model.enable=true", "reward_model.model.path=/models/rm",
                                                      "reward_model.micro_batch_size_per_gpu=8",
                                                      "reward_model.model.input_tokenizer=/models/policy"], fmt="verl")
    c = imp.config
    assert (c["reward.sources.rm.kind"], c["reward.sources.rm.model.path"], c["reward.sources.rm.micro_batch_size"]) == \
        ("model", "/models/rm", 8)
    seen = lines(imp)
    assert seen["reward_model.enable"][0] == "approximated" and "scores alone" in seen["reward_model.enable"][1]
    assert seen["reward_model.model.input_tokenizer"][0] == "not translated"
    off = import_config(None, ["reward_model.enable=false"], fmt="verl").config
    assert not any(k.startswith("reward.sources") for k in off)
