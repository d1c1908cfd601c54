"""fitrl.config: YAML + dotted overrides -> validated FitrlConfig, with one-line errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from fitrl.config import (ConfigError, FitrlConfig, config_to_dict, describe_fields, load_config,
                          save_config)
from fitrl.config.schema import ModelConfig


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, message
    return message


def leaves(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# ------------------------------------------------------------------ defaults and loading

def test_defaults():
    cfg = load_config(None)
    assert cfg == FitrlConfig()
    assert cfg.ref.model is None
    assert cfg.rollout.val.temperature == 0.0 and cfg.rollout.val.n == 1


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path / "empty.yaml", "")) == FitrlConfig()


def test_yaml_file_values(tmp_path):
    path = write(tmp_path / "run.yaml", """
        data:
          train_files: [a.jsonl, b.jsonl]
          rollout_batch_size: 16
        actor:
          optim:
            lr: 1e-5          # PyYAML reads this as a string
            lr_schedule: cosine
          mini_batch_size: 4
        rollout:
          n: 4
        trainer:
          max_steps: 3
        algorithm:
    """)
    cfg = load_config(path)
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.actor.optim.lr == 1e-5 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.optim.lr_schedule == "cosine"
    assert cfg.trainer.max_steps == 3
    assert cfg.algorithm == FitrlConfig().algorithm  # `algorithm:` with nothing under it


def test_overrides_parse_values():
    cfg = load_config(None, [
        "trainer.max_steps=20",
        "actor.optim.lr=1e-5",
        "data.train_files=[a.jsonl,b.jsonl]",
        "data.val_files=v.jsonl",
        "reward.kwargs.weight=0.5",
        "reward.kwargs.nested.deep=[1,2]",
        "actor.optim.betas=[0.9,0.95]",
        "algorithm.use_kl_loss=true",
        "trainer.run_dir=/tmp/run",
    ])
    assert cfg.trainer.max_steps == 20
    assert cfg.actor.optim.lr == 1e-5 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.data.val_files == ["v.jsonl"]
    assert cfg.reward.kwargs == {"weight": 0.5, "nested": {"deep": [1, 2]}}
    assert cfg.actor.optim.betas == [0.9, 0.95]
    assert cfg.algorithm.use_kl_loss is True
    assert cfg.trainer.run_dir == "/tmp/run"


def test_overrides_for_string_fields_keep_their_text():
    cfg = load_config(None, [
        "trainer.experiment_name=2024",
        "data.system_prompt=Answer: briefly",
        "data.prompt_template={{ prompt }}",
        "actor.model.path=/models/tiny",
        "data.train_files=007.jsonl",
    ])
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.data.system_prompt == "Answer: briefly"
    assert cfg.data.prompt_template == "{{ prompt }}"
    assert cfg.actor.model.path == "/models/tiny"
    assert cfg.data.train_files == ["007.jsonl"]


def test_overrides_win_over_file_and_later_overrides_win(tmp_path):
    path = write(tmp_path / "run.yaml", "trainer: {max_steps: 3, seed: 7}\n")
    cfg = load_config(path, ["trainer.max_steps=5", "trainer.max_steps=6"])
    assert cfg.trainer.max_steps == 6 and cfg.trainer.seed == 7


def test_optional_section_created_with_defaults():
    cfg = load_config(None, ["ref.model.path=/x"])
    assert cfg.ref.model == ModelConfig(path="/x")
    assert load_config(None, ["ref.model.path=/x", "ref.model=null"]).ref.model is None


def test_optional_values_accept_null():
    cfg = load_config(None, ["data.system_prompt=hello", "data.system_prompt=null"])
    assert cfg.data.system_prompt is None


def test_number_coercions():
    cfg = load_config(None, ["trainer.max_steps=20.0", "algorithm.kl_coef=0", "actor.optim.lr=2"])
    assert cfg.trainer.max_steps == 20 and isinstance(cfg.trainer.max_steps, int)
    assert cfg.algorithm.kl_coef == 0.0 and isinstance(cfg.algorithm.kl_coef, float)
    assert cfg.actor.optim.lr == 2.0 and isinstance(cfg.actor.optim.lr, float)


def test_every_leaf_can_be_overridden_with_its_default():
    overrides = [f"{key}={json.dumps(value)}" for key, value in leaves(config_to_dict(FitrlConfig()))]
    assert len(overrides) > 50
    assert load_config(None, overrides) == FitrlConfig()


# ------------------------------------------------------------------------------ base files

def test_base_chain_deep_merges_relative_to_including_file(tmp_path):
    write(tmp_path / "common" / "root.yaml", """
        trainer: {max_steps: 1, seed: 5}
        reward: {kwargs: {a: 1, b: 2}}
    """)
    write(tmp_path / "common" / "mid.yaml", """
        base: root.yaml
        trainer: {max_steps: 2}
        data: {train_files: [m.jsonl]}
    """)
    top = write(tmp_path / "exp" / "top.yaml", """
        base: ../common/mid.yaml
        trainer: {max_steps: 3}
        reward: {kwargs: {b: 3}}
    """)
    cfg = load_config(top)
    assert cfg.trainer.max_steps == 3
    assert cfg.trainer.seed == 5
    assert cfg.data.train_files == ["m.jsonl"]
    assert cfg.reward.kwargs == {"a": 1, "b": 3}


def test_base_cycle_rejected(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    assert "cycle" in error_of(str(tmp_path / "a.yaml"))
    write(tmp_path / "self.yaml", "base: self.yaml\n")
    assert "cycle" in error_of(str(tmp_path / "self.yaml"))


def test_base_missing_or_malformed(tmp_path):
    message = error_of(write(tmp_path / "x.yaml", "base: nope.yaml\n"))
    assert "nope.yaml" in message and "not found" in message
    assert "'base'" in error_of(write(tmp_path / "y.yaml", "base: [a, b]\n"))


def test_file_errors(tmp_path):
    assert "not found" in error_of(str(tmp_path / "missing.yaml"))
    assert "not valid YAML" in error_of(write(tmp_path / "bad.yaml", "trainer: [1, 2\n"))
    assert "mapping" in error_of(write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_malformed_override():
    assert "key=value" in error_of(overrides=["trainer.max_steps"])
    assert "key=value" in error_of(overrides=["trainer..max_steps=3"])


# ------------------------------------------------------------------------------ unknown keys

def test_unknown_key_suggests_sibling():
    assert error_of(overrides=["actor.optim.lrr=1"]) == (
        "unknown config key 'actor.optim.lrr' (in overrides); did you mean 'actor.optim.lr'?")


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path / "x.yaml", "data:\n  train_file: [a.jsonl]\n")
    assert error_of(path) == (
        f"unknown config key 'data.train_file' (in {path}); did you mean 'data.train_files'?")


def test_unknown_key_in_base_file_names_the_base(tmp_path):
    base = write(tmp_path / "base.yaml", "trainer: {max_stepz: 3}\n")
    top = write(tmp_path / "top.yaml", "base: base.yaml\ntrainer: {seed: 2}\n")
    assert f"(in {base})" in error_of(top)
    # an override of the same section does not take the blame for the base's key
    assert f"(in {base})" in error_of(top, ["trainer.seed=3"])


def test_unknown_key_suggests_key_in_other_section():
    assert "did you mean 'actor.optim.lr'?" in error_of(overrides=["trainer.lr=1e-5"])
    assert "did you mean 'rollout.temperature'?" in error_of(overrides=["trainer.temperature=1"])
    assert "did you mean 'algorithm.kl_coef'?" in error_of(overrides=["data.kl_coef=1"])


def test_unknown_section_names_the_full_key():
    assert error_of(overrides=["actr.optim.lr=1"]) == (
        "unknown config key 'actr.optim.lr' (in overrides); did you mean 'actor.optim.lr'?")
    assert "did you mean 'actor.optim.lr'?" in error_of(overrides=["optim.lr=1"])


def test_unknown_key_with_nothing_close_lists_the_section():
    message = error_of(overrides=["trainer.zzzzz=1"])
    assert message.startswith("unknown config key 'trainer.zzzzz' (in overrides); valid keys in 'trainer': ")
    assert "max_steps" in message and "progress_bar" in message
    assert "valid keys in the top level: data, algorithm" in error_of(overrides=["qqq=1"])


def test_moved_key_names_what_replaced_it(tmp_path):
    """An old config's ``plan.images`` gets one line naming the run keys that replaced it."""
    path = write(tmp_path / "old.yaml", "plan:\n  images: {per_prompt: 1, max_pixels: 4194304}\n")
    message = error_of(path)
    assert message.startswith(f"config key 'plan.images' (in {path}) was replaced: ")
    assert "plan.images.max_pixels -> data.max_pixels" in message
    assert "plan.images.per_prompt -> data.limit_images" in message and "plan.images.pixels" not in message
    assert error_of(overrides=["plan.images.max_pixels=1048576"]) == (
        "config key 'plan.images.max_pixels' (in overrides) was replaced: plan.images.max_pixels -> data.max_pixels")
    assert "plan.images.pixels -> nothing" in error_of(overrides=["plan.images.typo=1"])  # every moved key named


def test_moved_plan_rollout_names_the_run_keys_and_plan_emulate(tmp_path):
    """An old config's ``plan.rollout``: the vLLM engine's settings are ``rollout.*`` keys now, and
    the other frameworks' behaviours that fitrl's engine never has are ``plan.emulate.*``."""
    path = write(tmp_path / "old.yaml", "plan:\n  rollout: {engine: vllm, sleep_level: 2, swap_space_gib: 4}\n")
    assert error_of(path) == (
        f"config key 'plan.rollout' (in {path}) was replaced: plan.rollout.engine -> rollout.engine, "
        "plan.rollout.sleep_level -> rollout.sleep_level, plan.rollout.swap_space_gib -> plan.emulate.swap_space_gib")
    assert error_of(overrides=["plan.rollout.gpu_memory_utilization=0.5"]) == (
        "config key 'plan.rollout.gpu_memory_utilization' (in overrides) was replaced: "
        "plan.rollout.gpu_memory_utilization -> rollout.gpu_memory_utilization")
    assert error_of(overrides=["plan.rollout.free_cache_engine=true"]).endswith(
        "plan.rollout.free_cache_engine -> plan.emulate.free_cache_engine")
    message = error_of(overrides=["plan.rollout.typo=1"])  # every moved key named
    assert "plan.rollout.tensor_parallel_size -> rollout.tensor_parallel_size" in message
    assert "plan.rollout.separate_processes -> plan.emulate.separate_processes" in message


@pytest.mark.cli
@pytest.mark.parametrize("old,replaced", [("images: {per_prompt: 1, max_pixels: 4194304}",
                                           "plan.images.max_pixels -> data.max_pixels"),
                                          ("rollout: {engine: vllm, sleep_level: 2}", "plan.rollout.engine -> rollout.engine")])
def test_a_moved_key_is_one_line_from_the_cli(tmp_path, old, replaced):
    path = write(tmp_path / "old.yaml", f"plan:\n  {old}\n")
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "plan", path], capture_output=True, text=True)
    assert proc.returncode == 2 and replaced in proc.stderr
    assert "Traceback" not in proc.stderr


def test_free_form_dict_keys_are_allowed_but_base_is_not_an_override():
    assert load_config(None, ["reward.kwargs.anything_goes=1"]).reward.kwargs == {"anything_goes": 1}
    assert "unknown config key 'base'" in error_of(overrides=["base=x.yaml"])


# ------------------------------------------------------------------------------ wrong types

def test_wrong_int():
    assert error_of(overrides=["trainer.max_steps=abc"]) == (
        "config key 'trainer.max_steps' (in overrides) expects int, got str 'abc'")
    assert "expects int, got bool True" in error_of(overrides=["trainer.max_steps=true"])
    assert "expects int, got float 2.5" in error_of(overrides=["trainer.max_steps=2.5"])
    assert "expects int, got str '1e3'" in error_of(overrides=["trainer.max_steps=1e3"])


def test_wrong_float():
    assert "'actor.optim.lr' (in overrides) expects float, got str 'fast'" in error_of(
        overrides=["actor.optim.lr=fast"])
    assert "expects float, got bool True" in error_of(overrides=["algorithm.kl_coef=true"])


def test_wrong_bool():
    assert "'data.shuffle' (in overrides) expects bool, got int 1" in error_of(overrides=["data.shuffle=1"])
    assert "expects bool, got int 0" in error_of(overrides=["data.shuffle=0"])
    assert "expects bool, got str 'maybe'" in error_of(overrides=["data.shuffle=maybe"])


def test_wrong_str_in_file(tmp_path):
    path = write(tmp_path / "x.yaml", "trainer: {experiment_name: 2024}\n")
    assert error_of(path) == f"config key 'trainer.experiment_name' (in {path}) expects str, got int 2024"
    assert "expects str, got null" in error_of(overrides=["actor.model.path=null"])


def test_wrong_literal_lists_allowed_values():
    message = error_of(overrides=["actor.optim.lr_schedule=linear"])
    assert message == ("config key 'actor.optim.lr_schedule' (in overrides) expects one of "
                       "'constant', 'cosine', got str 'linear'")
    assert "'auto', 'cpu', 'cuda'" in error_of(overrides=["trainer.device=tpu"])


def test_wrong_list_and_dict():
    assert "'data.train_files[1]' (in overrides) expects str, got int 3" in error_of(
        overrides=["data.train_files=[a.jsonl,3]"])
    assert "'actor.optim.betas' (in overrides) expects list[float], got float 0.9" in error_of(
        overrides=["actor.optim.betas=0.9"])
    assert "'reward.kwargs' (in overrides) expects dict[str, Any], got int 3" in error_of(
        overrides=["reward.kwargs=3"])


def test_section_given_a_scalar(tmp_path):
    message = error_of(write(tmp_path / "x.yaml", "actor: 3\n"))
    assert message.startswith(f"config key 'actor' (in {tmp_path / 'x.yaml'}) is a section")
    assert "got int 3" in message and "mini_batch_size" in message
    assert "config key 'ref.model' (in overrides) is a section" in error_of(overrides=["ref.model=3"])
    assert "config key 'trainer' (in overrides) is a section" in error_of(overrides=["trainer=[1]"])


# -------------------------------------------------------------------- cross-field checks

def test_post_init_errors_pass_through_unchanged():
    assert error_of(overrides=["rollout.temperature=0"]).startswith("rollout.temperature must be > 0")
    assert error_of(overrides=["actor.optim.lr=0"]) == "actor.optim.lr must be a finite number > 0, got 0.0"
    assert error_of(overrides=["critic.optim.lr=-1"]) == "critic.optim.lr must be a finite number > 0, got -1.0"
    assert error_of(overrides=["actor.optim.betas=[0.9]"]) == "actor.optim.betas must be two values in [0, 1), got [0.9]"


def test_batch_size_cross_checks():
    message = error_of(overrides=["data.rollout_batch_size=6", "actor.mini_batch_size=4"])
    assert "data.rollout_batch_size=6" in message and "actor.mini_batch_size=4" in message
    message = error_of(overrides=["actor.micro_batch_size=3"])  # 8 prompts x 8 samples = 64 sequences
    assert "actor.micro_batch_size=3" in message and "64" in message
    assert "rollout.n must be >= 1" in error_of(overrides=["rollout.n=0"])
    cfg = load_config(None, ["data.rollout_batch_size=6", "actor.mini_batch_size=3", "actor.micro_batch_size=4"])
    assert cfg.actor.mini_batch_size == 3


# ------------------------------------------------------------------------- save and describe

def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(None, [
        "actor.optim.lr=3e-7", "actor.optim.betas=[0.9,0.95]", "data.train_files=[a.jsonl,b.jsonl]",
        "data.system_prompt=Think: then answer.", "ref.model.path=/ref", "ref.model.dtype=bfloat16",
        "reward.kwargs={weight: 0.5, names: [x, y], flag: true}", "trainer.experiment_name=007",
        "rollout.val.top_p=0.9", "algorithm.kl_coef=1e-4",
    ])
    path = tmp_path / "out" / "config.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path)) == cfg
    assert load_config(str(path)).ref.model == ModelConfig(path="/ref", dtype="bfloat16")
    save_config(FitrlConfig(), str(path))
    assert load_config(str(path)) == FitrlConfig()


def test_config_to_dict_is_plain():
    d = config_to_dict(FitrlConfig())
    assert d["actor"]["optim"]["lr"] == 1e-6 and d["ref"]["model"] is None
    assert yaml.safe_load(yaml.safe_dump(d)) == d


def test_describe_fields_every_leaf_documented():
    rows = describe_fields()
    keys = [key for key, _, _, _ in rows]
    assert len(keys) == len(set(keys))
    expected_leaves = {key for key, _ in leaves(config_to_dict(FitrlConfig()))}
    assert expected_leaves <= set(keys)
    assert {"ref.model.path", "ref.model.dtype"} <= set(keys)
    undocumented = [key for key, _, _, doc in rows if not doc.strip()]
    assert not undocumented, undocumented
    by_key = {key: (tp, default, doc) for key, tp, default, doc in rows}
    assert by_key["actor.optim.lr"] == ("float", "1e-06", "Peak learning rate of AdamW.")
    assert by_key["rollout.val.temperature"][1] == "0.0"  # the section's own default, not the class's
    assert by_key["actor.optim.lr_schedule"][0] == "'constant' | 'cosine'"
    assert by_key["ref.model"][:2] == ("ModelConfig | None", "None")
    assert by_key["trainer.run_dir"][0] == "str | None"


def test_every_described_key_is_accepted():
    for key, _, _, _ in describe_fields():
        try:
            load_config(None, [f"{key}=null"])
        except ConfigError as e:
            assert not str(e).startswith("unknown config key"), str(e)


def test_config_import_is_light():
    code = ("import sys, fitrl.config; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'datasets') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_is_a_dataclass_tree():
    assert dataclasses.is_dataclass(load_config(None).actor.optim)


@pytest.mark.parametrize("override,message", [
    ("rollout.val.top_p=0", "rollout.val.top_p must be in (0, 1]"),
    ("rollout.val.n=0", "rollout.val.n must be >= 1"),
    ("rollout.temperature=0", "use rollout.val.temperature=0 for greedy validation"),
    ("actor.ppo_epochs=0", "actor.ppo_epochs must be >= 1"),
    ("trainer.log_freq=0", "trainer.log_freq must be >= 1"),
    ("actor.micro_batch_size=5", "set actor.micro_batch_size to a divisor of 64 (e.g. 4)"),
])
def test_range_checks_say_what_to_change(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_low_precision_actor_rejected_reference_allowed():
    with pytest.raises(ConfigError, match="keep actor.model.dtype=float32"):
        load_config(None, ["actor.model.dtype=bfloat16"])
    assert load_config(None, ["ref.model.dtype=bfloat16"]).ref.model.dtype == "bfloat16"


def test_bare_off_reads_as_the_choice_off_not_a_boolean(tmp_path):
    # YAML 1.1 turns a bare off/on into a boolean; a field whose choices include "off" takes it as that
    path = tmp_path / "c.yaml"
    path.write_text("memory:\n  plan: off\n")
    assert load_config(str(path)).memory.plan == "off"
    assert load_config(None, ["memory.plan=off"]).memory.plan == "off"
    with pytest.raises(ConfigError, match="memory.plan"):
        load_config(None, ["memory.plan=true"])  # no "on" among its choices: still an error
