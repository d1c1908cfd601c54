"""A mixture-of-experts decoder (Qwen3-MoE) as its family describes it (fitrl/models/decoder.py,
``MoeLayout``): every tensor transformers builds, the active parameters' FLOPs, the memory
trace of its routed layers, a local tiny model, and the plan of Qwen3-30B-A3B on 8 x 80 GB."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from fitrl.config.roles import LoRAConfig
from fitrl.core.model_types import MODEL_TYPES
from fitrl.memory import trace
from fitrl.memory.trace import _traced, trace_spec, transient_bytes
from fitrl.models.decoder import MoeLayout
from fitrl.models.families import CAUSAL_LM
from fitrl.models.families.causal_lm import QWEN3_MOE_DEFAULTS
from fitrl.models.flops import FlopsShape
from fitrl.models.shape import ModelShape

ROOT = Path(__file__).resolve().parent.parent
A3B = ROOT / "tests/data/qwen3-30b-a3b"  # the published config.json of Qwen/Qwen3-30B-A3B
GIB = 2**30

SMALL = dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32, num_experts=6,
             num_experts_per_tok=2)


def _hf_tensors(config_cls: str, model_cls: str, **kwargs) -> tuple[list, dict]:
    """A transformers model of ``kwargs`` on the meta device: its named parameters and its config."""
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()], config.to_dict()


@pytest.mark.parametrize("variant", [
    {},
    dict(tie_word_embeddings=True, head_dim=32, norm_topk_prob=True),
    dict(mlp_only_layers=[1], attention_bias=True),  # a dense layer among the routed ones; every projection biased
    dict(decoder_sparse_step=2),                     # layers 1 and 3 route, 0 and 2 are dense
])
def test_the_layout_lists_every_parameter_transformers_builds(variant):
    real, config = _hf_tensors("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **{**SMALL, **variant})
    assert "num_local_experts" in config  # transformers 5 saves num_experts under its alias: read as such
    shape = ModelShape.from_dict(config)
    assert shape.decoder.kind == "moe" and shape.tensors() == real  # in named_parameters' order
    sparse = [shape.decoder.sparse(i) for i in range(4)]
    assert sparse == {"mlp_only_layers": [True, False, True, True],
                      "decoder_sparse_step": [False, True, False, True]}.get(next(iter(variant), ""), [True] * 4)
    assert shape.layer_params == max(sum(torch.Size(s).numel() for _, s in shape.layer_tensors(i)) for i in range(4))
    assert shape.num_params == sum(torch.Size(s).numel() for _, s in real)


def test_a_shared_expert_layout_lists_qwen2_moes_parameters():
    """The shared expert (Qwen2-MoE's: one dense MLP on every token, a one-output sigmoid gate)."""
    kwargs = {**SMALL, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48, "qkv_bias": True,
              "mlp_only_layers": [2]}
    real, config = _hf_tensors("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **kwargs)
    layout = MoeLayout(qkv_bias=True, shared_expert=True, aliases=(("num_experts", "num_local_experts"),))
    decoder = layout.read(config)
    assert sorted(t for i in range(4) for t in decoder.layer_tensors(i)) == sorted(
        t for t in real if t[0].startswith("model.layers."))
    assert decoder.intermediate == 2 * 32 + 48  # top-2 experts and the shared one, wider than the dense 96


def test_a_config_json_without_the_moe_keys_takes_transformers_defaults():
    from transformers import Qwen3MoeConfig

    defaults = Qwen3MoeConfig()
    assert all(getattr(defaults, k) == v for k, v in QWEN3_MOE_DEFAULTS)
    d = ModelShape.from_dict({k: v for k, v in SMALL.items() if k not in ("num_experts", "num_experts_per_tok",
                                                                         "moe_intermediate_size")}).decoder
    assert (d.experts, d.top_k, d.expert_intermediate) == (128, 8, 768)


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=8 of num_experts=6 experts: it must be between 1"):
        ModelShape.from_dict({**SMALL, "num_experts_per_tok": 8})


def test_the_row_is_a_moe_row_its_family_describes():
    from fitrl.trainer.complete import missing_counterparts

    assert MODEL_TYPES["qwen3_moe"].kind == "moe" and CAUSAL_LM.decoder_layout("qwen3_moe").kind == "moe"
    assert missing_counterparts() == []
    with pytest.raises(ValueError, match=r"describes a mixture of experts \(num_experts=6\)"):
        ModelShape.from_dict({**SMALL, "model_type": "qwen3"})  # a dense row's config that routes: still refused


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["gate"], ["down_proj"],
                                     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_adapters_are_peft_s_on_the_router_and_the_stacked_experts(targets):
    """PEFT adapts the router as a linear layer and the 3-D experts through its parameter wrapper
    (a doubled rank on the fused gate_up): the plan lists those adapters, shape for shape."""
    import transformers

    from fitrl.models.params import LoRA

    config = transformers.Qwen3MoeConfig(**{**SMALL, "mlp_only_layers": [1]})
    model = transformers.Qwen3MoeForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        LoRA(LoRAConfig(rank=4, target_modules=targets)).apply(model)
    real = sorted((n, tuple(p.shape)) for n, p in model.named_parameters() if ".lora_" in n)
    assert sorted(ModelShape.from_dict(config.to_dict()).lora_tensors(4, targets)) == real


# ------------------------------------------------------------------------------------------------
# FLOPs: the active parameters


def test_flops_per_token_follow_the_active_parameters():
    f = FlopsShape.from_path(A3B)
    assert f.num_params == pytest.approx(30.5e9, rel=2e-3)  # "30.5B in total, 3.3B activated" (Qwen3's card)
    active = f.linear_macs_per_token() + f.head_macs_per_token() + f.vocab * f.hidden  # + the embedding
    assert active == pytest.approx(3.3e9, rel=0.02)
    h, layers = 2048, 48
    attention = h * 4096 + 2 * h * 512 + 4096 * h
    per_layer = attention + 128 * h + 8 * 3 * h * 768  # the router, 8 of 128 experts
    assert f.linear_macs_per_token() == layers * per_layer
    # one response token at position 1: every matmul but the embedding lookup, twice (a MAC is 2 FLOPs)
    assert f.forward_flops(0, 1) == 2 * (active - f.vocab * f.hidden) + 2 * f.attention_macs(1)
    assert f.forward_flops(0, 1) == pytest.approx(2 * 3.04e9, rel=0.01)
    assert f.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2  # as a dense decoder's: 96 KiB in bf16


# ------------------------------------------------------------------------------------------------
# The memory trace of routed layers


def _moe(**kw) -> ModelShape:
    return ModelShape.from_dict({**SMALL, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                                 "num_experts": 8, "num_hidden_layers": 5, "vocab_size": 1000, **kw})


@pytest.mark.parametrize("phase,options", [("update", {}), ("update", dict(checkpointing=True)),
                                           ("update", dict(dtype="bfloat16")), ("logprob", {}), ("prefill", {})])
def test_the_meta_trace_of_a_moe_counts_the_fake_traces_bytes_and_extrapolates(phase, options):
    shape = _moe()
    spec = trace_spec(shape, phase=phase, batch=5, seq_len=21 if phase != "prefill" else 13,
                      response_len=9 if phase != "prefill" else 0, **options)
    assert dict(spec.text_config)["model_type"] == "qwen3_moe"
    for layers in (2, 3):
        assert trace._trace(spec, layers, "meta") == trace._trace(spec, layers, "fake"), layers
    assert transient_bytes(spec, 5) == _traced(spec, 5)  # two and three layers predict five


def test_a_moe_layers_activations_follow_its_top_k_experts_not_its_experts():
    def per_layer(**kw) -> int:
        spec = trace_spec(_moe(**kw), phase="update", batch=4, seq_len=64, response_len=32)
        return trace._trace(spec, 3, "meta") - trace._trace(spec, 2, "meta")

    tokens = 4 * 64
    base = per_layer()
    assert 0 < per_layer(num_experts=32) - base <= 4 * tokens * 24 * 4  # 24 more router columns: (T, E) fp32 copies
    assert per_layer(num_experts_per_tok=4) - base >= tokens * 2 * (2 * 64) * 4  # two more experts' gate_up rows


# ------------------------------------------------------------------------------------------------
# The tiny model: built here, loaded as a checkpoint is, planned to the parameter


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", arch="qwen3_moe")


def test_the_tiny_moe_loads_as_a_checkpoint_generates_and_is_planned_to_the_parameter(tiny_moe_dir):
    from fitrl.config.schema import FSDPConfig, ModelConfig
    from fitrl.models.loading import build_model, load_tokenizer
    from fitrl.models.tiny import describe

    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"]) == ("qwen3_moe", 4, 2, 128)
    assert describe(tiny_moe_dir)["num_experts"] == 4
    model_cfg = ModelConfig(path=str(tiny_moe_dir))
    model = build_model("causal_lm", model_cfg, FSDPConfig(), torch.device("cpu"))
    tokenizer = load_tokenizer(model_cfg)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    shape = ModelShape.from_path(tiny_moe_dir)
    assert shape.tensors() == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert shape.num_params == sum(p.numel() for p in model.parameters())

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], shape.vocab)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_the_trace_of_the_tiny_moe_equals_its_real_cpu_pass(tiny_moe_dir):
    """The trace runs transformers' fallback grouped matmul; the real CPU pass its grouped_mm
    kernel: the same bytes, within the batch's int64 inputs (as for a dense model)."""
    from test_plan_trace import B, R, T, _real_transient

    from fitrl.ops.logprob import response_logprobs

    def update(model, ids, mask, pos):
        logp, _ = response_logprobs(model, ids, mask, pos, R, chunk_size=64, with_entropy=True)
        (logp * torch.zeros(B, R)).sum().backward()

    shape = ModelShape.from_path(tiny_moe_dir)
    real = _real_transient(tiny_moe_dir, "causal_lm", update)
    spec = trace_spec(shape, phase="update", batch=B, seq_len=T, response_len=R, chunk=64)
    assert abs(transient_bytes(spec, shape.layers) - real) <= 1e-3 * real + 3 * B * T * 8


def test_the_tiny_moe_plans(tiny_moe_dir, tmp_path):
    from helpers import toy_config

    from fitrl.planner import Hardware, plan_config

    plan = plan_config(toy_config(tiny_moe_dir, tmp_path / "run", "trainer.device=cpu"),
                       Hardware.cpu(host_memory=64 * GIB))
    assert plan.verdict == "fits" and plan.shape.decoder.kind == "moe"
    update = plan.process("trainer").phases["update"].host
    assert update["params"] == 4 * plan.shape.num_params  # fp32, every expert


# ------------------------------------------------------------------------------------------------
# Qwen3-30B-A3B on one node of 8 x 80 GB


def test_qwen3_30b_a3b_on_8_gpus_of_80_gb(tmp_path):
    from fitrl.config import load_config
    from fitrl.planner import Hardware, plan_config

    cfg = load_config(str(ROOT / "examples/arith.yaml"), [
        f"actor.model.path={A3B}", f"trainer.run_dir={tmp_path}", "trainer.backend=ray", "trainer.devices_per_node=8",
        "actor.fsdp.offload_optimizer=true"])
    plan = plan_config(cfg, Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * GIB, host_memory=2 * 2**40,
                                     device="cuda"))
    update = plan.process("trainer").phases["update"].gpu
    assert update["params"] == pytest.approx(4 * 30.53e9 / 8, rel=1e-3)  # fp32, every expert, sharded over 8
    assert update["grads"] == update["params"] and update["optimizer"] == pytest.approx(2 * update["params"], rel=1e-3)
    # the HF engine gathers the whole bf16 model for a generate call: 57 GiB beside the shards
    rollout = plan.process("trainer").phases["rollout"].gpu
    assert rollout["gathered weights"] == pytest.approx(2 * 30.53e9 / GIB * GIB, rel=1e-3)
    assert plan.verdict == "tight" and plan.band("gpu")[0] == pytest.approx(0.12)
