"""What a mixture of experts holds on the CPU besides its states and traced passes: the checkpoint
file's pages of the experts that loading stacked (fitrl/memory/mapped.py), and the batch's
recorded routing (``routed_experts``, fitrl/memory/run.py). Dense plans have neither."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fitrl.models.shape import ModelShape

GIB = 2**30
PAGES = "checkpoint pages (experts)"


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", arch="qwen3_moe")


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = line.split()[-1] == str(path) if len(line.split()) > 5 else False
        elif current and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def _expert_bytes(model_dir, dtype_bytes: int = 4) -> int:
    return ModelShape.from_path(model_dir).decoder.stacked_expert_params * dtype_bytes


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_plain_cpu_load_keeps_the_checkpoints_expert_pages_mapped(tiny_moe_dir):
    """The premise of the plan's term: transformers stacks the checkpoint's per-expert matrices
    into new tensors, reading their pages into a mapping the other parameters keep alive; in
    another dtype every parameter is a copy and nothing stays mapped."""
    from safetensors import safe_open

    from fitrl.config.schema import FSDPConfig, ModelConfig
    from fitrl.models.loading import build_model

    file = (tiny_moe_dir / "model.safetensors").resolve()
    with safe_open(str(file), "pt") as f:  # the checkpoint holds each expert's matrices, as Qwen3-MoE's on the Hub
        assert any(".mlp.experts.0.gate_proj." in k for k in f.keys())
    experts = _expert_bytes(tiny_moe_dir)
    before = _mapped_kib(file)
    model = build_model("causal_lm", ModelConfig(path=str(tiny_moe_dir)), FSDPConfig(), torch.device("cpu"))
    held = (_mapped_kib(file) - before) * 1024
    assert experts <= held <= file.stat().st_size + 4096  # (pages: the tiny model's other tensors share them)
    del model
    bf16 = build_model("causal_lm", ModelConfig(path=str(tiny_moe_dir), dtype="bfloat16"), FSDPConfig(),
                       torch.device("cpu"))
    assert next(bf16.parameters()).dtype == torch.bfloat16 and _mapped_kib(file) == before


def _plan(model_dir, tmp_path, *overrides, hardware=None):
    from helpers import toy_config

    from fitrl.planner import Hardware, plan_config

    cfg = toy_config(model_dir, tmp_path / "run", "trainer.device=cpu", *overrides)
    return plan_config(cfg, hardware or Hardware.cpu(host_memory=64 * GIB))


def test_the_in_process_plan_holds_the_expert_pages_of_each_model_it_loads(tiny_moe_dir, tmp_path):
    experts = _expert_bytes(tiny_moe_dir)
    plan = _plan(tiny_moe_dir, tmp_path, "algorithm.use_kl_loss=true")
    trainer = plan.process("trainer").phases
    for phase in ("rollout", "old_logprob", "ref_logprob", "update"):
        assert trainer[phase].host[PAGES] == experts
        assert trainer[phase].host["ref " + PAGES] == experts  # the reference's own plain load maps them again
    assert PAGES not in trainer["load"].host  # (its checkpoint copy stands for the file there)
    bf16_ref = _plan(tiny_moe_dir, tmp_path, "algorithm.use_kl_loss=true", "ref.model.dtype=bfloat16")
    assert "ref " + PAGES not in bf16_ref.process("trainer").phases["ref_logprob"].host  # cast: unmapped
    assert PAGES in bf16_ref.process("trainer").phases["ref_logprob"].host


def test_sharded_or_cuda_plans_hold_no_expert_pages(tiny_moe_dir, tmp_path):
    from fitrl.planner import Hardware

    ray = _plan(tiny_moe_dir, tmp_path, "trainer.backend=ray", "trainer.devices_per_node=2",
                hardware=Hardware.cpu(ranks_per_node=2, host_memory=64 * GIB))
    gpu = Hardware(nodes=1, gpus_per_node=1, gpu_memory=80 * GIB, host_memory=64 * GIB, device="cuda")
    cuda = _plan(tiny_moe_dir, tmp_path, hardware=gpu)
    for plan in (ray, cuda):
        assert not any(PAGES in k for u in plan.process("trainer").phases.values() for k in u.host)


def test_the_batch_carries_the_recorded_routing_of_an_engine_that_records_it(tiny_moe_dir, tmp_path):
    from fitrl.memory import calibration as C
    from fitrl.memory.run import Run

    plan = _plan(tiny_moe_dir, tmp_path)
    run = Run(plan.cfg, plan.hardware, plan.shape, None, plan.spec)
    d = plan.shape.decoder
    assert run.routed_ids_per_token == d.sparse_layers * d.top_k == 4  # 2 layers x top-2
    plain = run.seq_len * C.BATCH_BYTES_PER_TOKEN + run.response_len * C.BATCH_BYTES_PER_RESPONSE_TOKEN
    assert run.batch_bytes(3) == 3 * (plain + run.response_len * 4 * 2)  # int16 ids
    vllm = dataclasses.replace(run, cfg=dataclasses.replace(
        plan.cfg, rollout=dataclasses.replace(plan.cfg.rollout, engine="vllm")))
    assert vllm.routed_ids_per_token == 0 and vllm.batch_bytes(3) == 3 * plain  # vLLM records none
