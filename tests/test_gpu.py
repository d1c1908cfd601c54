"""The CUDA paths, run where a GPU is (marked ``gpu``; skipped without CUDA): the real loop on
the device with per-phase GPU telemetry, offload between phases, the guard's GPU reading, and
rollout/trainer log-prob agreement on the device."""

from __future__ import annotations

import math
import time

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
        # the allocator's high-water mark holds the allocated one; the driver's view holds both plus the context
        assert last[f"mem/rank0/{phase}/gpu_peak_reserved_gib"] >= last[f"mem/rank0/{phase}/gpu_peak_gib"]
        assert last[f"mem/rank0/{phase}/gpu_device_used_gib"] > last[f"mem/rank0/{phase}/gpu_reserved_gib"]
    assert last["mem/gpu_peak_gib"] > 0
    # rollout (bf16/fp32 kernels of generate) and the trainer's forward agree on the same weights
    assert last["rollout/logprob_diff_mean"] < 1e-3


def test_offload_between_phases_keeps_weights_on_the_host(tiny_model_dir, tmp_path):
    from fitrl.config.schema import FSDPConfig
    from fitrl.roles.offload import OffloadBetweenPhases

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


def test_vl_grpo_on_cuda_with_images(tmp_path):
    """The vision-language path on the device: GRPO steps of a tiny Qwen2.5-VL on the shapes task
    (pictures through the vision tower), with per-phase GPU telemetry and log-prob agreement."""
    from fitrl.models.tiny import make_tiny_model
    from fitrl.trainer.run import train
    from test_vl_train import shapes_config

    model = make_tiny_model(tmp_path / "vl", arch="qwen2_5_vl", size="tiny", seed=0)
    history = train(shapes_config(model, tmp_path / "run", "trainer.device=cuda", "trainer.max_steps=3",
                                  "algorithm.fold_old_logprob=false"))  # the old-log-prob phase's peak too
    assert len(history) == 3
    steps = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m and "val/reward/mean" not in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # the task's overlong penalty can take up to 0.1 from an answer: the mean is in [-0.1, 1]
        assert math.isfinite(m["reward/mean"]) and -0.1 - 1e-6 <= m["reward/mean"] <= 1
        assert m["actor/grad_norm"] > 0
        # the rollout's log-probs and the update's forward see the same images and positions
        assert m["rollout/logprob_diff_mean"] < 1e-3, m["rollout/logprob_diff_mean"]
    last = steps[-1]
    peaks = {p: last[f"mem/rank0/{p}/gpu_peak_gib"] for p in ("rollout", "old_logprob", "update")}
    assert all(v > 0 for v in peaks.values()), peaks
    print("\nFIGURE vl_cuda", {"reward/mean": [m["reward/mean"] for m in steps],
                               "logprob_diff_mean": [m["rollout/logprob_diff_mean"] for m in steps],
                               "gpu_peak_gib": peaks, "mem/gpu_peak_gib": last.get("mem/gpu_peak_gib")})


def _drain_to_host(stream):
    """Copy every streamed tensor to the host as a push to a separate engine would, dropping the
    device tensor before the next one is made; returns the host copies, bytes and seconds."""
    host, nbytes = {}, 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for name, t in stream:
        host[name] = t.to("cpu")
        nbytes += t.numel() * t.element_size()
        del t
    torch.cuda.synchronize()
    return host, nbytes, time.perf_counter() - t0


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_weight_stream_on_cuda_is_the_state_dict_without_a_second_copy(tmp_path, dtype):
    """What a vLLM engine is fed (ParameterSet.inference_weights -> stream_full_tensors) from a
    CUDA model: every tensor equals the state dict's, and draining it holds at most one tensor
    beyond the model (never a second copy of it)."""
    from transformers import AutoModelForCausalLM

    from fitrl.models.params import ParameterSet
    from fitrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "small", arch="qwen2", size="small", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    torch.cuda.synchronize()
    sd = model.state_dict()
    out_dtype = dtype or torch.float32
    largest = max(v.numel() for v in sd.values()) * torch.empty((), dtype=out_dtype).element_size()
    ptrs = {v.data_ptr(): v.numel() * v.element_size() for v in sd.values()}
    weights = sum(ptrs.values())  # tied entries share storage: counted once
    # warm-up drain (first-call kernels, the caching allocator's first blocks)
    _drain_to_host(ParameterSet().inference_weights(model, dtype))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    host, nbytes, seconds = _drain_to_host(ParameterSet().inference_weights(model, dtype))
    extra = torch.cuda.max_memory_allocated() - base
    assert list(host) == list(sd)
    for name, v in sd.items():
        assert host[name].dtype == out_dtype and torch.equal(host[name], v.detach().cpu().to(out_dtype)), name
    # one allocator block of the largest tensor at most (rounded up to the allocator's 512 bytes)
    assert extra <= largest + 512, (extra, largest)
    if dtype is None:
        assert extra == 0, extra  # full tensors are the parameters themselves: no allocation at all
    # bare drain: what the generator itself costs, with no host copy
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _name, t in ParameterSet().inference_weights(model, dtype):
        del t
    torch.cuda.synchronize()
    bare = time.perf_counter() - t0
    print(f"\nFIGURE weight_stream dtype={out_dtype} model_weights={weights} B base_allocated={base} B "
          f"streamed={nbytes} B tensors={len(host)} largest={largest} B peak_extra={extra} B "
          f"to_host={seconds:.4f} s ({seconds / (nbytes / 1e9):.3f} s/GB, {nbytes / 1e9 / seconds:.2f} GB/s) "
          f"bare_drain={bare * 1e3:.2f} ms")


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_forward_equals_the_padded_one_on_cuda(tiny_model_dir, attn):
    """Padding-free packing on the device (fitrl/ops/packed.py): SDPA's packed mask, or
    flash-attention's varlen path where the package is installed; bf16 compute, fp32 weights."""
    from transformers import AutoModelForCausalLM

    from fitrl.ops.logprob import response_logprobs
    from test_packing import mixed_batch

    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attn).cuda()
    ids, mask, pos, R = (t.cuda() if isinstance(t, torch.Tensor) else t for t in mixed_batch(model.config.vocab_size))
    live = mask[:, -R:].bool()
    out = {}
    for pack in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, _ = response_logprobs(model, ids, mask, pos, R, pack=pack)
        grad = torch.autograd.grad((lp * live).sum(), list(model.parameters()))
        out[pack] = lp.detach(), grad
    assert (out[False][0] - out[True][0])[live].abs().max() < 3e-2  # bf16 kernels: rounding, not sequence leaks
    for a, b in zip(out[False][1], out[True][1]):
        assert (a - b).norm() <= 5e-2 * a.norm() + 1e-6


def test_reward_model_scores_on_cuda_as_on_cpu(tiny_model_dir, tmp_path):
    """The reward-model role on the device: the same scores as on the CPU, and the reward phase's
    GPU memory recorded in a run mixing it with the rule."""
    from fitrl.data.batch import Batch
    from fitrl.models.tiny import make_tiny_model
    from fitrl.roles.model_reward import RewardModelWorker
    from fitrl.trainer.run import train

    rm = make_tiny_model(tmp_path / "rm", seed=1, head="reward")
    src = ["reward.sources.rm.kind=model", f"reward.sources.rm.model.path={rm}", "reward.sources.rule.weight=1"]
    batch = Batch(fields={"prompt_messages": [[{"role": "user", "content": "What is 1 + 2?"}]] * 3,
                          "response_text": ["3", "four", ""]})
    on = {dev: RewardModelWorker(toy_config(tiny_model_dir, tmp_path / dev, f"trainer.device={dev}", *src), rank=0,
                                 world_size=1).score(batch)["rm"] for dev in ("cpu", "cuda")}
    assert on["cuda"].tolist() == pytest.approx(on["cpu"].tolist(), abs=1e-4)
    train(toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cuda", "trainer.max_steps=2",
                     "trainer.val_freq=0", *src))
    last = [m for m in read_metrics(tmp_path / "run") if "reward/mean" in m][-1]
    assert last["mem/rank0/reward/gpu_peak_gib"] > 0 and "reward/rm" in last
