"""The CUDA paths, run where a GPU is (marked ``gpu``; skipped without CUDA): the real loop on
the device with per-phase GPU telemetry, offload between phases, the guard's GPU reading, and
rollout/trainer log-prob agreement on the device."""

from __future__ import annotations

import pytest
import torch

from helpers import read_metrics, toy_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_loop_on_cuda_records_gpu_memory_per_phase(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    history = train(toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cuda", "trainer.max_steps=3",
                               "trainer.val_freq=0", "checkpoint.save_final=true"))
    assert len(history) == 3 and all(h["reward/mean"] >= 0 for h in history)
    steps = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m and "val/reward/mean" not in m]
    last = steps[-1]
    for phase in ("rollout", "old_logprob", "update"):
        assert last[f"mem/rank0/{phase}/gpu_peak_gib"] > 0, phase
        assert last[f"mem/rank0/{phase}/gpu_reserved_gib"] >= last[f"mem/rank0/{phase}/gpu_allocated_gib"]
    assert last["mem/gpu_peak_gib"] > 0
    # rollout (bf16/fp32 kernels of generate) and the trainer's forward agree on the same weights
    assert last["rollout/logprob_diff_mean"] < 1e-3


def test_offload_between_phases_keeps_weights_on_the_host(tiny_model_dir, tmp_path):
    from fitrl.config.schema import FSDPConfig
    from fitrl.roles.workers import OffloadBetweenPhases

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model.cuda()(torch.randn(2, 64, device="cuda")).sum().backward()
    opt.step()
    offload = OffloadBetweenPhases(model, FSDPConfig(offload_params=True, offload_optimizer=True),
                                   torch.device("cuda"), opt)
    assert model.weight.device.type == "cpu"
    assert all(v.device.type == "cpu" for s in opt.state.values() for k, v in s.items() if k != "step")
    with offload.phase(needs_optimizer=True):
        assert model.weight.device.type == "cuda"
        assert all(v.device.type == "cuda" for s in opt.state.values() for k, v in s.items() if k != "step")
    assert model.weight.device.type == "cpu"


def test_guard_reads_the_gpu_and_stops_above_its_fraction():
    from fitrl.config.schema import MemoryConfig
    from fitrl.telemetry.guard import GUARD, MemoryPressure

    GUARD.configure(MemoryConfig(guard_gpu_max_fraction=1e-6))  # any use of the device crosses it
    try:
        hold = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        with pytest.raises(MemoryPressure, match="GPU memory"):
            GUARD.check(torch.device("cuda"))
        del hold
    finally:
        GUARD.configure(MemoryConfig())
