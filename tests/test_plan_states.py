"""Model-state closed forms (fitrl.memory.states / shapes) equal the real tensors, byte for byte."""

import pytest
import torch

from fitrl.models.shape import ModelShape, numel
from fitrl.memory.states import frozen_states, next_power_of_two, shard_numel, tensors_bytes, trained_states
from fitrl.config.schema import FSDPConfig, ModelConfig, OptimConfig
from fitrl.models.loading import build_model
from fitrl.roles.actor import build_optimizer

STORY_MODELS = "examples/failure_stories/models"


def test_hand_checkable_pieces():
    assert shard_numel((10, 3), 4) == 9            # rows ceil(10/4) = 3, times 3 columns
    assert shard_numel((10, 3), 1) == 30
    assert shard_numel((7,), 8) == 1
    assert [next_power_of_two(n) for n in (1, 3, 4, 5, 34_000_000)] == [1, 4, 4, 8, 2**26]  # a 34 MB shard pins 64 MiB
    assert tensors_bytes([(10, 3)], 4, world=4) == 36
    assert tensors_bytes([(10, 3)], 4, world=4, pinned=True) == 64


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_closed_forms_equal_real_model_and_adamw_states(fixture, request):
    """params, gradients and AdamW states (both moments and the fp32 ``step`` per tensor) of a
    real model after one optimizer step sum to exactly the closed forms."""
    path = request.getfixturevalue(fixture)
    shape = ModelShape.from_path(path)
    model = build_model("causal_lm", ModelConfig(path=str(path)), FSDPConfig(), torch.device("cpu"))
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert sorted(numel(s) for _, s in shape.tensors()) == sorted(p.numel() for p in model.parameters())
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    ids = torch.randint(0, shape.vocab, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    st = trained_states(shape)
    assert st.params == sum(p.numel() * p.element_size() for p in model.parameters())
    assert st.grads == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    real_opt = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    assert st.optimizer == real_opt
    bf16 = build_model("causal_lm", ModelConfig(path=str(path), dtype="bfloat16"), FSDPConfig(), torch.device("cpu"))
    assert frozen_states(shape, dtype="bfloat16").params == sum(p.numel() * 2 for p in bf16.parameters())


def test_fsdp2_shards_equal_closed_form(tiny_model_dir):
    """Rank 0's FSDP2 shards over 3 ranks (dim 0 padded: 64 rows -> 22) as the closed form says,
    built on a fake process group (no other rank needed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitrl.distributed.fsdp import shard
    from fitrl.models.families import family_for

    shape = ModelShape.from_path(tiny_model_dir)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
        shard(model, FSDPConfig(), family_for(tiny_model_dir).blocks_to_shard(model), torch.device("cpu"))
        model.to_empty(device="cpu")
        local = sum(p.to_local().numel() for p in model.parameters())
        assert trained_states(shape, world=3).params == local * 4
        assert local > shape.num_params / 3  # padding is counted
    finally:
        dist.destroy_process_group()


def test_public_model_shapes():
    """Closed forms for the story models: the published parameter counts (checked once against
    transformers' own modules instantiated on the meta device) and Qwen2.5-7B's 56 KiB of KV per token."""
    qwen = ModelShape.from_path(f"{STORY_MODELS}/qwen2.5-7b-instruct")
    assert qwen.num_params == 7_615_616_512
    assert qwen.kv_bytes_per_token(2) == 56 * 1024
    assert ModelShape.from_path(f"{STORY_MODELS}/qwen2.5-vl-7b-instruct").num_params == 8_292_166_656
    assert ModelShape.from_path(f"{STORY_MODELS}/qwen2-vl-72b-instruct").num_params == 73_405_560_320


def test_vision_tower_tensors_match_transformers():
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = f"{STORY_MODELS}/qwen2.5-vl-7b-instruct"
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    real = sorted(p.numel() for p in model.parameters())
    assert sorted(numel(s) for _, s in ModelShape.from_path(path).tensors()) == real
    v = ModelShape.from_path(path).vision
    one = v.largest_image(1_048_576)  # 1 MP at 28 px per LM token: at most 1,337 = 7 x 191 tokens
    assert (one.height, one.width, one.grid) == (196, 5348, (1, 14, 382))
    assert (one.patches, one.llm_tokens) == (5348, 1337)          # 14x14 patches, 2x2 merged
    assert one.pixel_values_bytes == 5348 * 1176 * 4              # rows of 3 x 2 x 14 x 14 fp32
    assert v.largest_image(4 * 1_048_576).llm_tokens == 5348      # 28 x 191 (a square 4 MP image: 73 x 73)


@pytest.mark.parametrize("patch,max_pixels", [(14, 1_048_576), (14, 4_194_304), (16, 1_048_576), (14, 1_003_520)])
def test_largest_image_bounds_every_smart_resize(patch, max_pixels):
    """No image comes out of the processor's resize larger than ``largest_image``, which one does reach."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from fitrl.models.families.qwen_vl.tower import VisionShape

    v = VisionShape("qwen2_5_vl", 1, 8, 8, 8, patch=patch)
    big = v.largest_image(max_pixels, 3136)
    assert smart_resize(big.height, big.width, v.factor, 3136, max_pixels) == (big.height, big.width)
    sides = [*range(28, 3000, 37), *range(3000, 20000, 997)]
    worst = max(h * w for a in sides for b in sides if max(a, b) / min(a, b) <= 200
                for h, w in [smart_resize(a, b, v.factor, 3136, max_pixels)])
    assert worst <= big.height * big.width <= max_pixels


def test_pixel_values_equal_the_processor():
    """The processor's own output for the worst-case image: (patches, 3 * 2 * p * p) fp32 rows."""
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = ModelShape.from_path(f"{STORY_MODELS}/qwen2.5-vl-7b-instruct").vision
    one = v.largest_image(1_048_576)
    out = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=1_048_576)(
        images=[np.zeros((one.height, one.width, 3), dtype=np.uint8)], return_tensors="pt")
    pv = out["pixel_values"]
    assert out["image_grid_thw"].tolist() == [list(one.grid)]
    assert pv.numel() * pv.element_size() == one.pixel_values_bytes


def test_qwen3_vl_tensors_match_transformers():
    """Qwen3-VL: biased patch embedding (16 x 16 patches), learned positions, deepstack mergers;
    a Qwen3 decoder (q/k norms, no qkv bias). Checked name by name on the meta device."""
    from transformers import AutoModelForImageTextToText, Qwen3VLConfig

    cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1000,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0, 2]))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    shape = ModelShape.from_dict(cfg.to_dict())
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    real = {n.removeprefix("model."): tuple(p.shape) for n, p in model.named_parameters() if ".visual." in f".{n}"}
    assert real == {n: s for n, s in shape.tensors() if n.startswith("visual.")}
    assert (shape.decoder.qk_norm, shape.decoder.qkv_bias) == (True, False)
    assert (shape.vision.patch, shape.vision.factor) == (16, 32)
    assert shape.vision.largest_image(1_048_576).grid == (1, 64, 64)  # 32 x 32 LM tokens


def test_frozen_vision_tower_has_no_gradients_or_adamw_states():
    """``actor.model.freeze_vision_tower``: the tower keeps its weights; gradients and AdamW states
    (built over the parameters that require grad) cover the language model only."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from fitrl.models.families.qwen_vl.family import freeze_vision_tower

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1]))
    model = freeze_vision_tower(AutoModelForImageTextToText.from_config(cfg))
    shape = ModelShape.from_dict(cfg.to_dict())
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    st = trained_states(shape, frozen_vision=True)
    assert st.params == sum(p.numel() * 4 for p in model.parameters())
    assert st.grads == sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    assert st.optimizer == sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert st.grads < trained_states(shape).grads
