"""Model-state closed forms (fitrl.memory.states / shapes) equal the real tensors, byte for byte."""

import pytest
import torch

from fitrl.memory.shapes import ModelShape, numel
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
    assert (v.patches(1_048_576), v.llm_tokens(1_048_576)) == (5349, 1337)   # 1 MP: 14x14 patches, 2x2 merged
    assert v.pixel_values_bytes(1_048_576) == 5349 * 1176 * 4                 # rows of 3 x 2 x 14 x 14 fp32
