"""`fitrl train` plans memory first (memory.plan: enforce | warn | off) for the hardware it sees."""

import io
from pathlib import Path

import pytest
import yaml
from rich.console import Console

import fitrl.trainer.preflight
import fitrl.trainer.run
from fitrl.cli import main
from fitrl.core.errors import RunStopped
from fitrl.trainer.preflight import detect_hardware, preflight
from helpers import EXAMPLE, toy_config

ROOT = Path(__file__).resolve().parent.parent
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"  # config.json only
# Qwen2.5-7B trained on the CPU with 512-token responses: ~400 GiB in the update, over a 256 GiB
# node; gradient checkpointing brings it under (the plan's recommendation)
TOO_BIG = (f"actor.model.path={QWEN_7B}", "trainer.device=cpu", "rollout.max_response_length=512")


class Stop(Exception):
    """Raised where a test stops the run once the plan has passed."""


def console():
    out = io.StringIO()
    return Console(file=out, width=200), out


@pytest.fixture(autouse=True)
def fresh_plan_cache(tmp_path, monkeypatch):
    """A plan cache per test (fitrl/memory/cache.py): a hit would skip the planner these tests replace."""
    monkeypatch.setenv("FITRL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def node_256gib(monkeypatch):
    """This machine's RAM as the plan reads it: the same verdict on any test machine."""
    monkeypatch.setattr(fitrl.trainer.preflight, "node_total_bytes", lambda: 256 * 1024**3)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the run gets as far as the reward, the tokenizer (and weight files) or the model weights."""
    def loaded(*args, **kwargs):
        raise AssertionError("the run went past the memory plan")
    for name in ("RewardSources", "check_run_models", "make_group"):
        monkeypatch.setattr(fitrl.trainer.run, name, loaded)


@pytest.mark.slow
def test_toy_config_fits_one_line_and_trains(tiny_model_dir, tmp_path):
    c, out = console()
    history = fitrl.trainer.run.train(toy_config(tiny_model_dir, tmp_path / "run", "memory.plan=enforce",
                                                 "trainer.max_steps=1", "trainer.val_before_train=false",
                                                 "data.val_files=[]"), c)
    text = out.getvalue()
    assert len(history) == 1
    plan_lines = [line for line in text.splitlines() if "memory plan" in line]
    assert len(plan_lines) == 1 and plan_lines[0].startswith("memory plan: fits, peak host"), text
    assert "GPU –" in plan_lines[0] and "peak host memory per node" not in text


@pytest.mark.slow
def test_too_big_stops_before_anything_loads(tiny_model_dir, tmp_path, node_256gib, no_loading):
    c, out = console()
    with pytest.raises(RunStopped) as err:
        fitrl.trainer.run.train(toy_config(QWEN_7B, tmp_path / "run", *TOO_BIG, "memory.plan=enforce"), c)
    message = str(err.value)
    assert "host memory on node 0 in update" in message and "GiB ±10% against" in message and "trainer rank" in message
    assert "cheapest change that fits: actor.model.gradient_checkpointing=true" in message
    assert "memory.plan=warn" in message
    text = out.getvalue()
    assert "does not fit" in text and "peak host memory per node" in text and "recommendations" in text
    assert not (tmp_path / "run").exists()  # stopped before the run directory was made


def test_cli_too_big_exit_1_with_plan(tmp_path, capsys, node_256gib, no_loading):
    code = main(["train", EXAMPLE, *TOO_BIG, f"trainer.run_dir={tmp_path / 'run'}"])
    captured = capsys.readouterr()
    assert code == 1
    assert "peak host memory per node" in captured.out and "to apply: actor.model.gradient_checkpointing=true" in captured.out
    assert captured.err.startswith("fitrl: run stopped: predicted not to fit")
    assert "memory.plan=warn" in captured.err and "Traceback" not in captured.err


def test_warn_prints_the_plan_and_goes_on(tmp_path, monkeypatch, node_256gib):
    def stop(*args, **kwargs):
        raise Stop  # the next step of the run: it got past the plan
    monkeypatch.setattr(fitrl.trainer.run, "RewardSources", stop)
    c, out = console()
    with pytest.raises(Stop):
        fitrl.trainer.run.train(toy_config(QWEN_7B, tmp_path / "run", *TOO_BIG, "memory.plan=warn"), c)
    text = out.getvalue()
    assert "does not fit" in text and "to apply: actor.model.gradient_checkpointing=true" in text
    assert "warning: predicted not to fit" in text and "going on because memory.plan=warn" in text


def test_off_does_not_plan(tiny_model_dir, tmp_path, monkeypatch):
    def planner(*args, **kwargs):
        raise AssertionError("planned with memory.plan=off")
    monkeypatch.setattr(fitrl.trainer.preflight, "plan_config", planner)
    monkeypatch.setattr(fitrl.trainer.preflight, "detect_hardware", planner)
    c, out = console()
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "memory.plan=off")  # YAML's false, read as 'off'
    assert cfg.memory.plan == "off" and preflight(cfg, c) is None
    assert out.getvalue() == ""


def test_planner_crash_is_one_line_and_training_goes_on(tiny_model_dir, tmp_path, monkeypatch):
    def planner(*args, **kwargs):
        raise RuntimeError("no model of this attention")
    monkeypatch.setattr(fitrl.trainer.preflight, "plan_config", planner)
    c, out = console()
    history = fitrl.trainer.run.train(toy_config(tiny_model_dir, tmp_path / "run", "memory.plan=enforce",
                                                 "trainer.max_steps=1", "trainer.val_before_train=false",
                                                 "data.val_files=[]"), c)
    assert len(history) == 1
    assert "memory plan skipped: RuntimeError: no model of this attention" in out.getvalue()


def test_unmodelled_model_type_is_skipped(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    c, out = console()
    assert preflight(toy_config(model, tmp_path / "run", "memory.plan=enforce"), c) is None
    assert out.getvalue().startswith("memory plan skipped: ValueError: model_type 'gpt2' is not modelled")


def test_detected_hardware_replaces_plan_hardware(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(fitrl.trainer.preflight, "node_total_bytes", lambda: 64 * 1024**3)
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cpu")
    hw = detect_hardware(cfg)
    assert (hw.device, hw.nodes, hw.gpus_per_node, hw.gpu_memory, hw.host_memory) == ("cpu", 1, 1, 0, 64 * 1024**3)
    ray = toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cpu", "trainer.backend=ray",
                     "trainer.devices_per_node=2", "actor.micro_batch_size=16", "actor.logprob_micro_batch_size=32")
    assert (detect_hardware(ray).nodes, detect_hardware(ray).gpus_per_node) == (1, 2)
    c, out = console()
    plan = preflight(toy_config(tiny_model_dir, tmp_path / "run", "memory.plan=enforce", "trainer.device=cpu",
                                "plan.hardware.host_memory=2TiB",  # a user's plan.hardware (for other machines)
                                "plan.steps=7"), c)
    assert plan.hardware.host_memory == 64 * 1024**3
    assert plan.cfg.plan.steps == 7
    assert "plan.hardware is read by `fitrl plan`" in out.getvalue()


def test_cli_passes_the_plan_section(tmp_path, monkeypatch):
    seen = {}

    def fake_train(cfg, console=None):
        seen.update(cfg=cfg)
        return []
    monkeypatch.setattr(fitrl.trainer.run, "train", fake_train)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"base": EXAMPLE, "rollout": {"n": 4}, "actor": {"micro_batch_size": 16},
                                    "plan": {"emulate": {"swap_space_gib": 4}, "hardware": {"host_memory": "1TiB"}}}))
    assert main(["train", str(path), "plan.emulate.separate_processes=true"]) == 0
    assert seen["cfg"].rollout.n == 4
    assert (seen["cfg"].plan.emulate.swap_space_gib, seen["cfg"].plan.emulate.separate_processes) == (4, True)
    assert seen["cfg"].plan.hardware.host_memory == "1TiB"  # carried, not read: preflight notes that it ignores it
    assert main(["train", str(path), "plan.emulate.swap_space=4"]) == 2  # a typo in the plan section is a config error
    assert main(["train", str(path), "plan.rollout.engine=vllm"]) == 2  # moved to rollout.engine: one line says so


def test_cuda_detection_and_fits_line(tiny_model_dir, tmp_path, monkeypatch):
    """No GPU here: CUDA as torch would report an 80 GiB device."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 1024**3))
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "memory.plan=enforce")  # trainer.device=auto
    hw = detect_hardware(cfg)
    assert (hw.device, hw.gpus_per_node, hw.gpu_memory) == ("cuda", 1, 80 * 1024**3)
    c, out = console()
    assert preflight(cfg, c).fits
    assert "GiB per node (" in out.getvalue() and "of 80.0 GiB per device (" in out.getvalue()
