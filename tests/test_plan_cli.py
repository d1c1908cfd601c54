"""`fitrl plan`: the subcommand, the planner-only `plan:` section, a bare config.json."""

import argparse
import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from fitrl.config import ConfigError
from fitrl.memory import add_plan_command, load_plan_config, plan_inputs_from_dict
from fitrl.memory.cli import run_plan
from fitrl.memory.inputs import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
STORY_MODELS = ROOT / "examples" / "failure_stories" / "models"


def parse(*argv):
    parser = argparse.ArgumentParser(prog="fitrl")
    add_plan_command(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 1024**3
    assert parse_bytes("2TB") == 2 * 1000**4
    assert parse_bytes("251 GB") == 251 * 1000**3
    assert parse_bytes(1024) == 1024
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("lots")


def test_bare_config_json_plans_and_fits(tmp_path, monkeypatch):
    """actor.model.path holding only config.json is enough; 8 x 80 GiB fit Qwen2.5-7B GRPO."""
    model = tmp_path / "qwen"
    model.mkdir()
    shutil.copy(STORY_MODELS / "qwen2.5-7b-instruct" / "config.json", model / "config.json")
    args = parse(str(ROOT / "examples" / "arith.yaml"), f"actor.model.path={model}", "trainer.backend=ray",
                 "trainer.devices_per_node=8", "actor.fsdp.mixed_precision=true", "data.max_prompt_length=1024",
                 "rollout.max_response_length=1024", "data.rollout_batch_size=64", "actor.mini_batch_size=32",
                 "actor.micro_batch_size=4", "actor.logprob_micro_batch_size=8",
                 "actor.model.gradient_checkpointing=true", "--gpu-memory", "80GiB", "--host-memory", "1TiB",
                 "--no-recommend")
    cfg, section = load_plan_config(args.config, args.overrides)
    section["hardware"] = {"gpus_per_node": 8, "gpu_memory": "80GiB", "host_memory": "1TiB"}
    out = io.StringIO()
    code = run_plan(cfg, plan_inputs_from_dict(section), recommend_changes=False,
                    console=Console(file=out, width=200))
    text = out.getvalue()
    assert code == 0, text
    assert "fits" in text and "update" in text and "trainer rank" in text
    assert args.fn.__name__ == "cmd_plan"


def test_story_exit_status_and_recommendation(capsys):
    args = parse(str(ROOT / "examples" / "failure_stories" / "5_every_rank_reads_checkpoint.yaml"),
                 f"actor.model.path={STORY_MODELS / 'qwen2-vl-72b-instruct'}")
    assert args.fn(args) == 1
    text = capsys.readouterr().out
    assert "does not fit" in text and "load" in text
    assert "actor.fsdp.init every_rank -> rank0" in text
    assert "to apply: actor.fsdp.init=rank0" in text


def test_plan_section_and_overrides(tmp_path):
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"base: {ROOT / 'examples' / 'arith.yaml'}\n"
                        "plan:\n  hardware: {gpus_per_node: 4, host_memory: 512GiB}\n  rollout: {engine: vllm}\n")
    cfg, section = load_plan_config(str(cfg_path), ["plan.rollout.tensor_parallel_size=2", "rollout.n=16"])
    inputs = plan_inputs_from_dict(section)
    assert cfg.rollout.n == 16 and cfg.data.max_prompt_length == 64  # from the base file
    assert (inputs.hardware.gpus_per_node, inputs.hardware.host_memory) == (4, 512 * 1024**3)
    assert (inputs.rollout.engine, inputs.rollout.tensor_parallel_size) == ("vllm", 2)
    with pytest.raises(ConfigError, match="unknown planner key 'plan.rollout.gpu_mem'"):
        plan_inputs_from_dict({"rollout": {"gpu_mem": 0.5}})
    with pytest.raises(ConfigError, match="did you mean 'rollout.n'"):
        load_plan_config(str(cfg_path), ["rollout.nn=4"])


def test_missing_config_json_is_a_config_error(tmp_path):
    cfg, section = load_plan_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="no config.json"):
        run_plan(cfg, plan_inputs_from_dict(section), recommend_changes=False, console=Console(file=io.StringIO()))
