"""The varlen attention path of packed forwards (fitrl/ops/varlen.py): the boundaries from packed
positions, the kernel's call against a dense block mask, a whole packed pass (log-probs and
gradients, gradient checkpointing included) equal to the dense one, and the choice per device.
On CPU the kernel is ``reference_varlen`` (one SDPA per sequence); torch's flash kernel runs in
the gpu tier."""

from __future__ import annotations

import logging

import pytest
import torch

from fitrl.config.schema import ActorConfig, AlgorithmConfig
from fitrl.ops import varlen as V
from fitrl.roles.actor import Actor
from helpers import assert_same_pass, logprobs_and_grads
from test_packing import mixed_batch


def test_segments_by_hand():
    cu, longest = V.segments(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]))
    assert cu.tolist() == [0, 3, 5, 6, 10, 12] and cu.dtype == torch.int32 and longest == 6


def test_block_mask_by_hand():
    cu, _ = V.segments(torch.tensor([[0, 1, 0]]))
    assert V.block_causal_mask(cu, 3, 1)[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_varlen_call_equals_sdpa_with_the_block_mask(hq, hkv):
    """The attention function's reshapes and GQA: the same output as SDPA over the dense mask."""
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3]])
    rows, W, d = 2, 7, 8
    q = torch.randn(rows, hq, W, d, generator=g)
    k, v = (torch.randn(rows, hkv, W, d, generator=g) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, hq // hkv
    with V.using_kernel(V.reference_varlen):
        out, _ = V.varlen_attention(module, q, k, v, None, scaling=d ** -0.5, position_ids=pos)
    cu, _ = V.segments(pos)
    mask = V.block_causal_mask(cu, W, rows)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5,
                                                           enable_gqa=hq != hkv).transpose(1, 2)
    assert out.shape == (rows, W, hq, d)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fitrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("models") / "qwen2-tiny", arch="qwen2", size="tiny")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _actor(model):
    return Actor(model, ActorConfig(), AlgorithmConfig(), total_steps=1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_packed_pass_through_the_varlen_path_equals_the_dense_one(tiny, checkpointing):
    """Log-probs, entropies and gradients of a packed pass whose attention runs as varlen (no
    mask built) equal the dense-mask pass; with gradient checkpointing the recomputed forwards
    in backward run inside the same context (Actor.sequence_parallel is held over backward)."""
    if checkpointing:
        tiny.gradient_checkpointing_enable()
    try:
        ids, mask, pos, R = mixed_batch(tiny.config.vocab_size)
        live = mask[:, -R:].bool()
        dense = logprobs_and_grads(tiny, ids, mask, pos, R, temperature=1.0, entropy_grad=False, pack=True)
        calls = []
        counting = lambda *a, **k: calls.append(1) or V.reference_varlen(*a, **k)  # noqa: E731
        with V.using_kernel(counting), _actor(tiny).sequence_parallel():
            assert tiny.config._attn_implementation == V.VARLEN
            tiny.train()  # (checkpointing recomputes in train mode only)
            packed = logprobs_and_grads(tiny, ids, mask, pos, R, temperature=1.0, entropy_grad=False, pack=True)
        assert tiny.config._attn_implementation == "sdpa"
        assert_same_pass(dense, packed, live)
        layers = tiny.config.num_hidden_layers
        assert len(calls) == layers * (2 if checkpointing else 1)  # every layer, again in backward when recomputed
    finally:
        tiny.gradient_checkpointing_disable()
        tiny.eval()


def test_a_padded_forward_inside_the_pass_keeps_its_mask(tiny):
    """Inside the context a forward with a padding mask (not packed) runs SDPA with that mask."""
    ids, mask, pos, R = mixed_batch(tiny.config.vocab_size)
    with torch.no_grad():
        plain = tiny(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        with V.using_kernel(V.reference_varlen), _actor(tiny).sequence_parallel():
            inside = tiny(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    live = mask.bool()
    assert torch.allclose(plain[live], inside[live], atol=1e-5)


def test_the_choice_per_device_and_its_line(tiny, caplog, monkeypatch):
    cpu, line = V.packed_kernel(tiny.config, torch.device("cpu"))
    assert cpu is None and "dense block mask" in line and "cpu" in line
    monkeypatch.setattr(V, "torch_varlen_kernel", lambda: V.reference_varlen)
    chosen, line = V.packed_kernel(tiny.config, torch.device("cuda"))
    assert chosen == V.VARLEN and "varlen_attn" in line
    monkeypatch.setattr(V, "torch_varlen_kernel", lambda: None)
    chosen, line = V.packed_kernel(tiny.config, torch.device("cuda"))
    assert chosen is None and "no varlen_attn" in line
    monkeypatch.setattr(V, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="fitrl.ops.varlen"), V.packed_attention(tiny, torch.device("cpu")):
        assert tiny.config._attn_implementation == "sdpa"  # CPU: the model's own attention
    assert "attention for packed sequences: sdpa with a dense block mask" in caplog.text
    eager = type(tiny.config)(**{**tiny.config.to_dict(), "attn_implementation": "eager"})
    eager._attn_implementation = "eager"
    assert V.packed_kernel(eager, torch.device("cuda"))[0] is None  # eager keeps its mask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_varlen_kernel_equals_the_dense_mask_on_cuda():
    """The flash varlen kernel against SDPA over the block mask, bf16 (what the GPU default computes in)."""
    kernel = V.torch_varlen_kernel()
    if kernel is None:
        pytest.skip("this torch has no varlen_attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4]], device="cuda")
    q = torch.randn(2, 4, 8, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 8, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    out, _ = V.varlen_attention(module, q, k, v, None, scaling=0.125, position_ids=pos)
    cu, _ = V.segments(pos)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=V.block_causal_mask(cu, 8, 2),
                                                           scale=0.125, enable_gqa=True).transpose(1, 2)
    assert (out.float() - ref.float()).abs().max() < 2e-2


def _tower_run(model, pixels, grid):
    out = model.model.visual(pixels, grid_thw=grid)
    hidden = out.last_hidden_state
    hidden.square().sum().backward()  # the update's backward through the tower too
    grads = [p.grad.clone() for p in model.model.visual.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return hidden.detach(), grads


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_vision_tower_attends_its_windows_in_one_call_per_layer(arch, tmp_path):
    """The towers hand an implementation named "flash" their windows' cu_seqlens in one call:
    the output and the gradients equal the per-window SDPA calls transformers makes otherwise,
    one kernel call per block, each over several windows (two pictures)."""
    from transformers import AutoModelForImageTextToText

    from fitrl.models.tiny import make_tiny_model

    model = AutoModelForImageTextToText.from_pretrained(make_tiny_model(tmp_path / arch, arch=arch, size="tiny"),
                                                        dtype=torch.float32)
    vc = model.config.vision_config
    grid = torch.tensor([[1, 8, 8], [1, 4, 8]])  # two pictures' (t, h, w) patch grids
    width = getattr(vc, "in_channels", 3) * vc.temporal_patch_size * vc.patch_size ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(0))
    assert V.use_varlen_vision(model, torch.device("cpu")) is None and vc._attn_implementation == "sdpa"  # CPU: unchanged
    plain = _tower_run(model, pixels, grid)
    windows = []
    counting = lambda q, k, v, cu, *a, **kw: windows.append(len(cu) - 1) or V.reference_varlen(q, k, v, cu, *a, **kw)  # noqa: E731
    with V.using_kernel(counting):
        assert V.use_varlen_vision(model, torch.device("cpu")) is not None and vc._attn_implementation == V.VISION
        varlen = _tower_run(model, pixels, grid)
    assert len(windows) == len(model.model.visual.blocks) and min(windows) >= 2
    assert torch.allclose(plain[0], varlen[0], atol=1e-6)
    for a, b in zip(plain[1], varlen[1]):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_varlen_kernel_over_a_towers_windows_on_cuda():
    """Bidirectional windows (a vision tower's), bf16: the kernel against one SDPA per window."""
    if V.torch_varlen_kernel() is None:
        pytest.skip("this torch has no varlen_attn")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 96, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 64, 80, 96], device="cuda", dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = False, 1
    out, _ = V.vision_varlen_attention(module, q, k, v, scaling=0.125, cu_seq_lens_q=cu, max_length_q=64)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), scale=0.125)
                     for a, b in ((0, 64), (64, 80), (80, 96))], dim=2).transpose(1, 2)
    assert (out.float() - ref.float()).abs().max() < 2e-2
