"""bf16 the GPU default: a role's unset ``fsdp.mixed_precision`` resolves per device (bf16 autocast or
FSDP2 bf16 over fp32 masters on CUDA, fp32 on CPU as before), the engine follows the trainer, and
``fitrl import-config`` carries the source's dtypes (fitrl/config/schema.py, import_maps.py)."""

from __future__ import annotations

import pytest

from fitrl.config import load_config
from fitrl.config.importer import import_config
from fitrl.config.schema import default_mixed_precision
from helpers import ROOT

EXAMPLE = ROOT / "examples" / "arith.yaml"


@pytest.mark.parametrize("role,device,backend,expected", [
    ("actor", "cuda", "ray", True), ("ref", "cuda", "ray", True), ("critic", "cuda", "ray", True),
    ("actor", "cuda", "inprocess", True), ("ref", "cuda", "inprocess", True),
    ("critic", "cuda", "inprocess", False),  # its bf16 needs FSDP2: a default must not be a config error
    ("actor", "cpu", "ray", False), ("actor", "cpu", "inprocess", False), ("critic", "cpu", "ray", False),
])
def test_the_default_precision_per_device(role, device, backend, expected):
    assert default_mixed_precision(role, device, backend) is expected


def _config(*overrides: str):
    return load_config(str(EXAMPLE), list(overrides))


def test_unset_resolves_per_device_and_set_is_kept():
    cfg = _config("trainer.backend=ray", "trainer.devices_per_node=2", "critic.fsdp.mixed_precision=false")
    assert cfg.actor.fsdp.mixed_precision is None  # unset until the device is known
    cuda, cpu = cfg.with_device_defaults("cuda"), cfg.with_device_defaults("cpu")
    assert (cuda.actor.fsdp.mixed_precision, cuda.ref.fsdp.mixed_precision, cuda.critic.fsdp.mixed_precision) == \
        (True, True, False)  # the user's false is kept
    assert (cpu.actor.fsdp.mixed_precision, cpu.ref.fsdp.mixed_precision) == (False, False)
    assert cfg.actor.fsdp.mixed_precision is None and cuda.trainer is cfg.trainer  # a copy; the rest shared
    assert cuda.with_device_defaults("cpu").actor.fsdp.mixed_precision is True  # resolved once


def test_the_engine_computes_in_the_trainers_dtype_on_cuda():
    """vLLM's dtype comes from the actor's compute dtype: bf16 on CUDA by default, the weights' on CPU."""
    from fitrl.roles.rollout_worker import compute_dtype as engine_dtype
    cfg = _config("trainer.backend=ray", "trainer.devices_per_node=2")
    assert engine_dtype(cfg.with_device_defaults("cuda")) == "bfloat16"
    assert engine_dtype(cfg.with_device_defaults("cpu")) == "float32"


def test_a_cuda_plan_counts_bf16_and_a_cpu_plan_is_unchanged(tiny_model_dir):
    from fitrl.planner import Hardware, plan_config

    cfg = _config(f"actor.model.path={tiny_model_dir}")
    explicit = _config(f"actor.model.path={tiny_model_dir}", "actor.fsdp.mixed_precision=true",
                       "ref.fsdp.mixed_precision=true")
    off = _config(f"actor.model.path={tiny_model_dir}", "actor.fsdp.mixed_precision=false",
                  "ref.fsdp.mixed_precision=false")
    gpu = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30, host_memory=256 * 2**30, device="cuda")
    assert plan_config(cfg, gpu).peaks() == plan_config(explicit, gpu).peaks()
    cpu = Hardware(gpus_per_node=1, gpu_memory=0, host_memory=24 * 2**30, device="cpu")
    assert plan_config(cfg, cpu).peaks() == plan_config(off, cpu).peaks()


@pytest.mark.parametrize("fmt,source,expected", [
    ("verl", ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
              "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16",
              "actor_rollout_ref.rollout.dtype=bfloat16"],
     {"actor.fsdp.mixed_precision": True, "ref.fsdp.mixed_precision": True, "critic.fsdp.mixed_precision": True}),
    # (keys a source leaves out keep its defaults: veRL computes every role in bf16, tests/test_import_defaults.py)
    ("verl", ["actor_rollout_ref.rollout.dtype=bfloat16"],
     {"actor.fsdp.mixed_precision": True, "ref.fsdp.mixed_precision": True, "critic.fsdp.mixed_precision": True}),
    ("verl", ["actor_rollout_ref.actor.fsdp_config.param_dtype=fp32", "actor_rollout_ref.rollout.dtype=bfloat16"],
     {"actor.fsdp.mixed_precision": False, "ref.fsdp.mixed_precision": True,
      "critic.fsdp.mixed_precision": True}),  # the trainer's own dtype decides the engine's
    ("easyr1", ["worker.actor.fsdp.mp_param_dtype=bf16", "worker.actor.fsdp.torch_dtype=fp32",
                "worker.ref.fsdp.torch_dtype=bf16", "worker.rollout.dtype=bf16"],
     {"actor.fsdp.mixed_precision": True, "ref.fsdp.mixed_precision": True}),
    ("easyr1", ["worker.actor.fsdp.mp_param_dtype=fp32"],
     {"actor.fsdp.mixed_precision": False, "ref.fsdp.mixed_precision": True}),
])
def test_the_importer_maps_the_sources_dtypes(fmt, source, expected):
    path = "actor_rollout_ref.model.path=/m" if fmt == "verl" else "worker.actor.model.model_path=/m"
    imp = import_config(None, [path, *source], fmt=fmt)
    assert {k: v for k, v in imp.config.items() if k.endswith("mixed_precision")} == expected
    shown = {line[1].split("=")[0]: line[0] for line in imp.lines}
    assert all(shown[s.split("=")[0]] != "not translated" for s in source), imp.lines
