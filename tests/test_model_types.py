"""One table of model types (fitrl/core/model_types.py), and every reader of a model directory
knows each row: a family loads it, the model shape (memory plan and FLOPs alike) describes it, and
a vision-language row has a vision spec. A new row that one of them misses fails here."""

from __future__ import annotations

import json

import pytest

from fitrl.core.model_types import DECODER_TYPES, MODEL_TYPES, VIDEO_TYPES, VISION_LANGUAGE_TYPES, decoder_family
from fitrl.models.flops import FlopsShape
from fitrl.models.shape import ModelShape

TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, tie_word_embeddings=True)
VISION = {  # the towers' config.json keys, tiny
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=112,
                       fullatt_block_indexes=[1]),
    "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                     num_position_embeddings=16, deepstack_visual_indexes=[0]),
}


def config(model_type: str) -> dict:
    if model_type in VISION_LANGUAGE_TYPES:
        return {"model_type": model_type, "text_config": {**TEXT, "model_type": model_type},
                "vision_config": VISION[model_type]}
    return {"model_type": model_type, **TEXT}


def test_the_table_partitions_into_decoders_and_vision_language_models():
    assert set(DECODER_TYPES) | VISION_LANGUAGE_TYPES == set(MODEL_TYPES)
    assert not set(DECODER_TYPES) & VISION_LANGUAGE_TYPES and VIDEO_TYPES <= VISION_LANGUAGE_TYPES
    assert all(decoder_family(t) in DECODER_TYPES for t in MODEL_TYPES)
    assert set(VISION) == VISION_LANGUAGE_TYPES  # this test's own configs cover every VL row


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_every_model_type_is_described_once_for_memory_and_flops(model_type):
    cfg = config(model_type)
    shape = ModelShape.from_dict(cfg)
    flops = FlopsShape.from_config(cfg)
    assert shape.num_params > 0 and flops.forward_flops(4, 4) > 0
    assert (shape.vision is None) == (flops.vision is None) == (model_type not in VISION_LANGUAGE_TYPES)
    # the FLOPs read the same dimensions the memory plan does
    assert (flops.hidden, flops.layers, flops.heads, flops.kv_heads, flops.head_dim, flops.intermediate, flops.vocab) == \
        (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, shape.vocab)
    if shape.vision is not None:
        assert flops.vision_flops([64]) > 0 and flops.vision.depth == shape.vision.depth


@pytest.mark.parametrize("model_type", sorted(MODEL_TYPES))
def test_every_model_type_has_a_family_and_vision_language_ones_a_vision_spec(model_type, tmp_path):
    from fitrl.models.families.qwen_vl.media import VL_MODEL_TYPES
    from fitrl.models.families import CAUSAL_LM, QWEN_VL, family_for
    from fitrl.models.vl_types import auto_class_name

    (tmp_path / "config.json").write_text(json.dumps(config(model_type)))
    vl = model_type in VISION_LANGUAGE_TYPES
    assert family_for(tmp_path) is (QWEN_VL if vl else CAUSAL_LM)
    assert auto_class_name(model_type) == ("AutoModelForImageTextToText" if vl else "AutoModelForCausalLM")
    assert (model_type in VL_MODEL_TYPES) == vl


def test_a_dense_model_type_outside_the_table_still_has_flops_but_no_plan():
    """transformers runs text decoders fitrl's table does not list (models/check.py accepts them):
    their MFU is still logged; the memory plan, which lists every tensor, refuses them in one line."""
    cfg = {**TEXT, "model_type": "phi3"}
    assert FlopsShape.from_config(cfg).forward_flops(4, 4) == FlopsShape.from_config(config("llama")).forward_flops(4, 4)
    with pytest.raises(ValueError, match="not modelled by the planner"):
        ModelShape.from_dict(cfg)
