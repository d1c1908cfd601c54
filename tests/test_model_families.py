"""Model families (fitrl.models.families) and the import-light ground floor of fitrl.distributed."""

import subprocess
import sys

import pytest
import torch

import fitrl.models.families
from fitrl.config.schema import FSDPConfig, ModelConfig
from fitrl.core.errors import ConfigError
from fitrl.core.padding import position_ids_from_mask
from fitrl.core.registry import Registry
from fitrl.models.families import CAUSAL_LM, MODEL_FAMILIES, CausalLMFamily, family_for
from fitrl.models.loading import build_model


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_dir"])
def test_text_models_are_causal_lm(fixture, request):
    path = request.getfixturevalue(fixture)
    family = family_for(path)
    assert family is CAUSAL_LM and "causal_lm" in MODEL_FAMILIES
    model = build_model("causal_lm", ModelConfig(path=str(path)), FSDPConfig(), torch.device("cpu"))
    blocks = family.blocks_to_shard(model)
    assert len(blocks) == model.config.num_hidden_layers
    assert all(type(b).__name__.endswith("DecoderLayer") for b in blocks)


def test_causal_lm_positions_count_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    ids = torch.zeros_like(mask)
    inputs = CAUSAL_LM.inputs_for(torch.nn.Linear(1, 1))
    assert torch.equal(inputs.positions(ids, mask), position_ids_from_mask(mask))
    assert inputs.extra({"input_ids": ids}, torch.device("cpu")) == {}


def test_family_is_picked_by_model_type(tiny_model_dir, tmp_path, monkeypatch):
    class Claims(CausalLMFamily):
        name = "claims_qwen2"
        model_types = frozenset({"qwen2"})

    registry = Registry("model family", "actor.model.family")
    registry.add("causal_lm", CAUSAL_LM)
    registry.add("claims_qwen2", claims := Claims())
    monkeypatch.setattr(fitrl.models.families, "MODEL_FAMILIES", registry)
    assert family_for(tiny_model_dir) is claims
    assert family_for(tiny_model_dir, "causal_lm") is CAUSAL_LM
    monkeypatch.undo()
    assert family_for(tiny_model_dir) is CAUSAL_LM
    with pytest.raises(ConfigError, match="did you mean 'causal_lm'"):
        family_for(tiny_model_dir, "causal_ml")
    with pytest.raises(ConfigError, match="no config.json"):
        family_for(tmp_path)


def test_unknown_head_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown model head 'regression'"):
        CAUSAL_LM.builders("regression", ModelConfig(path=str(tiny_model_dir)))


def test_process_group_module_needs_no_torch():
    code = ("import sys, fitrl.distributed.process_group as pg; assert 'torch' not in sys.modules; "
            "assert pg.DistEnv.single().world_size == 1")
    subprocess.run([sys.executable, "-c", code], check=True)
