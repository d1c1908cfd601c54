"""`fitrl plan`: the subcommand, the config's `plan:` section, a bare config.json."""

import argparse
import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from fitrl.config import ConfigError, load_config
from fitrl.config.plan import parse_bytes
from fitrl.memory import Hardware
from fitrl.planner.cli import add_plan_command, run_plan

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


@pytest.mark.slow
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
    cfg = load_config(args.config, [*args.overrides, "plan.hardware.gpus_per_node=8",
                                    "plan.hardware.gpu_memory=80GiB", "plan.hardware.host_memory=1TiB"])
    out = io.StringIO()
    code = run_plan(cfg, Hardware.for_config(cfg), recommend_changes=False, console=Console(file=out, width=200))
    text = out.getvalue()
    assert code == 0, text
    assert "fits" in text and "update" in text and "trainer rank" in text
    assert args.fn.__name__ == "cmd_plan"


@pytest.mark.slow
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
                        "plan:\n  hardware: {gpus_per_node: 4, host_memory: 512GiB}\n  emulate: {swap_space_gib: 4}\n")
    cfg = load_config(str(cfg_path), ["plan.emulate.free_cache_engine=true", "rollout.n=16"])
    hardware = Hardware.for_config(cfg)
    assert cfg.rollout.n == 16 and cfg.data.max_prompt_length == 64  # from the base file
    assert (hardware.gpus_per_node, hardware.host_memory) == (4, 512 * 1024**3)
    assert (cfg.plan.emulate.swap_space_gib, cfg.plan.emulate.free_cache_engine) == (4, True)
    with pytest.raises(ConfigError, match="unknown config key 'plan.emulate.zzz'"):
        load_config(str(cfg_path), ["plan.emulate.zzz=0.5"])
    with pytest.raises(ConfigError, match="did you mean 'plan.emulate.free_cache_engine'"):
        load_config(str(cfg_path), ["plan.emulate.free_cache_engin=true"])
    with pytest.raises(ConfigError, match="did you mean 'rollout.n'"):
        load_config(str(cfg_path), ["rollout.nn=4"])
    with pytest.raises(ConfigError, match="plan.hardware.host_memory='lots' is not a size"):
        load_config(str(cfg_path), ["plan.hardware.host_memory=lots"])


def test_hardware_flags_over_plan_hardware_over_trainer(tmp_path):
    """Flags win over plan.hardware, which wins over trainer.*; a CPU run defaults to this machine's RAM."""
    arith = str(ROOT / "examples" / "arith.yaml")
    cfg = load_config(arith, ["trainer.nnodes=2", "trainer.devices_per_node=4", "trainer.backend=ray",
                              "actor.micro_batch_size=1", "actor.mini_batch_size=8", "plan.hardware.nodes=3"])
    hw = Hardware.for_config(cfg)
    assert (hw.nodes, hw.gpus_per_node, hw.gpu_memory, hw.host_memory, hw.device) == (
        3, 4, 80 * 1024**3, 2 * 1024**4, "cuda")
    assert Hardware.for_config(cfg, nodes=5, gpu_memory=141 * 10**9).nodes == 5
    cpu = Hardware.for_config(load_config(arith, ["trainer.device=cpu"]))
    assert (cpu.device, cpu.gpu_memory) == ("cpu", 0) and cpu.host_memory == Hardware.cpu().host_memory
    args = parse(arith, "--gpu-memory", "lots")
    with pytest.raises(ConfigError, match="--gpu-memory='lots' is not a size"):
        args.fn(args)


def test_missing_config_json_is_a_config_error(tmp_path):
    cfg = load_config(str(ROOT / "examples" / "arith.yaml"), [f"actor.model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="no config.json"):
        run_plan(cfg, Hardware.for_config(cfg), recommend_changes=False, console=Console(file=io.StringIO()))


def test_plan_plans_this_machine_by_default(capsys, tiny_model_dir):
    """`fitrl plan` of a trainer.device=auto config plans where `fitrl train` would run; the model's
    size reads in people's units; the process table has no GPU column on a CPU plan."""
    import torch

    from fitrl.cli import main

    code = main(["plan", str(ROOT / "examples" / "arith.yaml"), f"actor.model.path={tiny_model_dir}", "--no-recommend"])
    out = capsys.readouterr().out
    assert code == 0
    if torch.cuda.is_available():
        assert out.startswith("planning this machine: ") and "GPU(s) of" in out
    else:
        assert out.startswith("planning this machine: CPU only") and "\non CPU, 1 rank(s)" in out
        assert "GPU GiB" not in out
    assert "qwen2 156K params (2 layers" in out  # the tiny model: 156,224 parameters
    main(["plan", str(ROOT / "examples" / "arith.yaml"), f"actor.model.path={tiny_model_dir}", "--gpu-memory", "80GiB",
          "--no-recommend"])
    assert "planning this machine" not in capsys.readouterr().out  # other hardware named: planned as named


def test_count_text():
    from fitrl.planner.report import count_text

    assert [count_text(n) for n in (156_224, 494_032_768, 7_615_616_512, 12)] == ["156K", "494M", "7.62B", "12"]


@pytest.mark.slow
def test_the_flagship_example_fits_its_hardware_with_the_config_only_model(capsys):
    from fitrl.cli import main

    config = str(ROOT / "examples" / "geo3k_qwen2_5_vl_7b.yaml")
    assert main(["plan", config, "--no-recommend"]) == 2  # the weights are not here: say where a config-only copy is
    err = capsys.readouterr().err
    assert "to plan without the weights, its config.json alone is in" in err and "ref.model.path=" in err
    model = STORY_MODELS / "qwen2.5-vl-7b-instruct"
    assert main(["plan", config, f"actor.model.path={model}", f"ref.model.path={model}"]) == 0
    out = capsys.readouterr().out
    assert "\nfits, peaks taken at the top of the plan's band" in out and "a device 77.6 of 80.0 GiB" in out
    assert "speed-ups that still fit" in out
    # its former rollout.micro_batch_size does not fit; the first recommendation lowers the deciding peak
    assert main(["plan", config, f"actor.model.path={model}", f"ref.model.path={model}",
                 "rollout.micro_batch_size=128"]) == 1
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ ") and "->" in line]
    assert rows[0].startswith("│ rollout.micro_batch_size 128 -> 64") and "data.val_batch_size" in rows[-1]


def test_the_plan_fits_an_80_column_terminal(capsys, monkeypatch, tiny_model_dir):
    """Issue 37: the plan's prose wraps and its tables fit 80 columns (a table per resource, a part
    per line, a recommendation's cost under it), on a CPU plan and on a GPU plan that does not fit
    (notes, growth, recommendations); the change keys are folded, never cut."""
    from fitrl.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    main(["plan", str(ROOT / "examples" / "arith.yaml"), f"actor.model.path={tiny_model_dir}"])
    cpu = capsys.readouterr().out
    assert main(["plan", str(ROOT / "examples" / "failure_stories" / "3_host_grows_each_rollout.yaml")]) == 1
    gpu = capsys.readouterr().out
    for out in (cpu, gpu):
        assert max(len(line) for line in out.splitlines()) <= 80, out
        assert "…" not in out
    assert "peak GPU memory per device" in gpu and "peak host memory per node" in gpu
    assert "plan.emulate.free_cache_engine true ->" in gpu and "no growth (was +" in gpu
    assert "to apply: plan.emulate.free_cache_engine=false" in gpu
