"""Model FLOPs from config.json, device peaks, MFU, and the perf/* keys of a real step
(fitrl/models/flops.py, fitrl/telemetry/perf.py, fitrl/trainer/perf.py; docs/metrics.md)."""

import json
import math

import pytest
import torch

from fitrl.data.batch import Batch
from fitrl.models.shape import ModelShape
from fitrl.models.flops import FlopsShape
from fitrl.telemetry import perf as telemetry_perf
from fitrl.telemetry.perf import cache_file, cpu_peak_flops, gpu_peak_flops, mfu
from fitrl.trainer.logging import format_step_line
from helpers import ROOT, read_metrics, toy_config

# the tiny test model's shape (fitrl/models/tiny.py, size "tiny")
TINY = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "tie_word_embeddings": True}


def test_tiny_config_by_hand():
    s = FlopsShape.from_config(TINY)
    assert (s.head_dim, s.kv_heads) == (16, 2)
    # per layer and token: q 64x64 = 4096, k and v 64x(2*16) = 2048 each, o 64x64 = 4096 -> 12,288;
    # MLP 3 x 64 x 256 = 49,152; both layers: 2 x 61,440 = 122,880 MACs
    assert s.linear_macs_per_token() == 122_880
    assert s.head_macs_per_token() == 64 * 512 == 32_768
    # attention over S = 5 causal tokens: positions attend 1+2+3+4+5 = 15 keys, QK and AV each
    # 15 x (4 heads x 16) MACs: 2 x 15 x 64 = 1,920 per layer, 3,840 for two = L S (S+1) n_q d
    assert s.attention_macs(5) == 3_840
    # prompt 3 + response 2: 5 x 122,880 + 3,840 + 2 (response tokens) x 32,768 = 683,776 MACs
    assert s.forward_flops(3, 2) == 2 * 683_776 == 1_367_552
    assert s.training_flops(3, 2) == 3 * 1_367_552
    # LoRA: weights' matmuls 2x forward (no weight gradients), attention's 3x
    weights = 5 * 122_880 + 2 * 32_768
    assert s.training_flops(3, 2, lora=True) == 2 * (2 * weights + 3 * 3_840)
    assert s.batch_forward_flops([3, 1], [2, 0]) == s.forward_flops(3, 2) + s.forward_flops(1, 0)


def test_gqa_counts_fewer_key_value_heads():
    mha = FlopsShape.from_config({**TINY, "num_key_value_heads": 4})
    gqa = FlopsShape.from_config(TINY)
    # k and v shrink from 64x64 to 64x32 in each of 2 layers: 2 x 2 x 64 x 32 = 8,192 MACs per token
    assert mha.linear_macs_per_token() - gqa.linear_macs_per_token() == 8_192
    # attention scores use the query heads: the same for both
    assert mha.attention_macs(7) == gqa.attention_macs(7)
    # explicit head_dim (Qwen3 style) wins over hidden / heads
    wide = FlopsShape.from_config({**TINY, "head_dim": 32})
    assert wide.attention_macs(1) == 2 * 1 * 2 * 4 * 32


def test_tied_embeddings_cost_the_same_work():
    tied = FlopsShape.from_config(TINY)
    untied = FlopsShape.from_config({**TINY, "tie_word_embeddings": False})
    assert tied.forward_flops(10, 6) == untied.forward_flops(10, 6)
    # ... although the parameter count differs by the head (which a 6N estimate would count twice)
    assert (ModelShape.from_dict({**TINY, "tie_word_embeddings": False}).num_params
            - ModelShape.from_dict(TINY).num_params) == 512 * 64


def test_linear_macs_match_the_planner_weights_of_a_real_config():
    """Qwen2.5-7B: every decoder matmul's MACs per token = its weight's elements (biases aside)."""
    cfg = json.loads((ROOT / "examples/failure_stories/models/qwen2.5-7b-instruct/config.json").read_text())
    shape, flops = ModelShape.from_dict(cfg), FlopsShape.from_config(cfg)
    weights = sum(math.prod(s) for i in range(shape.layers) for _, s in shape.layer_tensors(i) if len(s) == 2)
    assert flops.linear_macs_per_token() == weights
    # ~2 x 6.5e9 non-embedding parameters per token, plus the head on response tokens
    assert flops.forward_flops(0, 1) == 2 * (weights + flops.attention_macs(1) + 3584 * 152064)


def test_qwen2_5_vl_vision_tower_by_hand():
    vision = {"depth": 2, "hidden_size": 8, "intermediate_size": 16, "num_heads": 2, "in_chans": 3,
              "out_hidden_size": 64, "patch_size": 2, "spatial_merge_size": 2, "window_size": 4,
              "fullatt_block_indexes": [1], "temporal_patch_size": 2}
    s = FlopsShape.from_config({**TINY, "model_type": "qwen2_5_vl", "vision_config": vision})
    v = s.vision
    assert (v.window_patches, v.full_attention_blocks) == (4, 1)   # (4 px / 2 px)^2 patches per window
    patches = 16
    embed = 3 * 2 * 2 * 2 * 8                      # Conv3d over a 3 x 2 x 2 x 2 patch into 8 channels = 192
    block = 3 * 8 * 8 + 8 * 8 + 3 * 8 * 16        # qkv 192 + proj 64 + gated MLP 384 = 640
    attention = 2 * 16 * 8 + 2 * 4 * 8             # one full block (16 keys) + one windowed (4 keys): 320
    merger = 32 * 32 + 32 * 64                     # 2x2 patches -> 32 wide -> 64 (the LM width): 3,072
    macs = patches * (embed + 2 * block) + patches * attention + (patches // 4) * merger
    assert v.forward_flops(patches) == 2 * macs == 2 * (16 * 1_472 + 16 * 320 + 4 * 3_072)
    assert s.forward_flops(3, 2, image_patches=[16]) == FlopsShape.from_config(TINY).forward_flops(3, 2) + 2 * macs
    # a frozen tower (LoRA) costs 2x its forward in training: activation gradients only
    assert s.training_flops(3, 2, image_patches=[16], lora=True) - s.training_flops(3, 2, lora=True) == 4 * macs


def test_qwen2_vl_vision_config_keys():
    cfg = json.loads((ROOT / "examples/failure_stories/models/qwen2-vl-72b-instruct/config.json").read_text())
    v = FlopsShape.from_config(cfg).vision
    # Qwen2-VL: embed_dim 1280, mlp_ratio 4 (fc1/fc2), merger out = vision_config.hidden_size (the LM's 8192)
    assert (v.hidden, v.intermediate, v.out_hidden, v.gated_mlp, v.window_patches) == (1280, 5120, 8192, False, None)


def test_mixture_of_experts_is_refused():
    with pytest.raises(ValueError, match="mixture of experts"):
        FlopsShape.from_config({**TINY, "num_experts": 8})
    with pytest.raises(ValueError, match="intermediate_size"):
        FlopsShape.from_config({k: v for k, v in TINY.items() if k != "intermediate_size"})


def test_mfu_arithmetic():
    # 3e12 FLOPs in 2 s on 2 devices of 1e12 FLOP/s each: 1.5e12 / 2e12 = 0.75
    assert mfu(3e12, 2.0, 1e12, devices=2) == pytest.approx(0.75)
    assert mfu(1e12, 0.0, 1e12) == 0.0


def test_gpu_peak_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert gpu_peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", "float16") == 312e12
    assert gpu_peak_flops("NVIDIA A10", "bfloat16") == 125e12          # not matched by the A100 row
    assert gpu_peak_flops("NVIDIA A100 80GB PCIe", "float32") == 19.5e12
    assert gpu_peak_flops("NVIDIA A100 80GB PCIe", "float32", tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA L40S", "bfloat16") == 362e12
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090", "bfloat16") == 165.2e12
    assert gpu_peak_flops("Tesla V100-SXM2-32GB", "float32", tf32=True) == 15.7e12  # Volta has no tf32
    assert gpu_peak_flops("NVIDIA A10G", "bfloat16") is None           # unknown: no MFU, not a guess


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FITRL_CACHE_DIR", str(tmp_path / "mine"))  # fitrl's cache directory wins
    assert cache_file() == tmp_path / "mine" / "peak_flops.json"
    monkeypatch.delenv("FITRL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_file() == tmp_path / "xdg" / "fitrl" / "peak_flops.json"
    calls = []

    def fake_measure(dtype, threads):
        calls.append((dtype, threads))
        return 1e11 * threads

    assert cpu_peak_flops(2, "float32", measure=fake_measure) == 2e11
    assert cpu_peak_flops(2, "float32", measure=fake_measure) == 2e11   # from the cache
    assert calls == [("float32", 2)]
    assert cpu_peak_flops(1, "float32", measure=fake_measure) == 1e11   # another thread count: measured
    assert cpu_peak_flops(2, "bfloat16", measure=fake_measure) == 2e11  # another dtype: measured
    assert len(calls) == 3
    saved = json.loads(cache_file().read_text())
    assert len(saved) == 3 and all(e["flops"] > 0 for e in saved.values())
    # a corrupt cache is measured over, not fatal
    cache_file().write_text("{not json")
    assert cpu_peak_flops(2, "float32", measure=fake_measure) == 2e11 and len(calls) == 4


def test_real_matmul_benchmark_gives_a_rate():
    assert telemetry_perf.measure_matmul_flops("float32", 1, budget_s=0.02) > 1e8   # any CPU does 0.1 GFLOP/s


def _rollout_batch(prompt_lens, response_lens, width_p=4, width_r=3):
    """A batch in the engine's layout: prompts left-padded to width_p, responses right-padded."""
    att = torch.zeros(len(prompt_lens), width_p + width_r, dtype=torch.long)
    resp = torch.zeros(len(prompt_lens), width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        att[i, width_p - p:width_p + r] = 1
        resp[i, :r] = 1
    return Batch(tensors={"attention_mask": att, "response_mask": resp})


def test_step_perf_counts_tokens_from_masks(tiny_model_dir):
    from fitrl.trainer.perf import StepPerf, sequence_lengths

    batch = _rollout_batch([4, 2], [3, 1])
    assert sequence_lengths(batch) == ([4, 2], [3, 1])
    cfg = toy_config(tiny_model_dir, "unused", "trainer.peak_flops=1e9", "actor.ppo_epochs=2",
                     "algorithm.use_kl_loss=true")
    perf = StepPerf(cfg)
    times = {"rollout": 0.5, "old_logprob": 0.25, "ref": 0.25, "update": 1.0, "reward": 2.0}
    m = perf.metrics(batch, {"rollout": [([4, 2], [3, 1])]}, times)
    # 10 tokens (4+3 and 2+1); 4 generated
    assert m["perf/rollout_tokens_per_s"] == pytest.approx(4 / 0.5)
    assert m["perf/logprob_tokens_per_s"] == pytest.approx(2 * 10 / 0.5)     # old + ref passes
    assert m["perf/update_tokens_per_s"] == pytest.approx(2 * 10 / 1.0)      # two PPO epochs
    assert m["perf/tokens_per_s"] == pytest.approx(10 / 4.0)                 # over the whole step
    shape = FlopsShape.from_config(TINY)
    forward = shape.forward_flops(4, 3) + shape.forward_flops(2, 1)
    assert m["perf/flops_per_token"] == pytest.approx(forward / 10)
    total = forward + 2 * forward + 2 * 3 * forward                            # rollout, logprob, update
    assert m["perf/step_flops"] == pytest.approx(total)
    assert m["perf/peak_flops"] == 1e9
    assert m["perf/mfu"] == pytest.approx(total / 4.0 / 1e9)
    assert m["perf/update_mfu"] == pytest.approx(6 * forward / 1.0 / 1e9)
    line = format_step_line(3, {"time/step": 4.0, **m})
    assert f"{10 / 4.0:,.0f} tok/s mfu " in line


def test_short_run_logs_perf(tiny_model_dir, tmp_path, monkeypatch):
    from fitrl.trainer.run import train

    monkeypatch.delenv("FITRL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the CPU benchmark's cache
    run_dir = tmp_path / "run"
    train(toy_config(tiny_model_dir, run_dir, "trainer.max_steps=1", "rollout.n=2", "data.val_files=[]",
                     "actor.mini_batch_size=8", "actor.micro_batch_size=16", "checkpoint.save_final=false",
                     "algorithm.fold_old_logprob=false"))  # a log-prob pass to time
    (step,) = read_metrics(run_dir)
    for key in ("perf/rollout_tokens_per_s", "perf/logprob_tokens_per_s", "perf/update_tokens_per_s",
                "perf/tokens_per_s", "perf/flops_per_token", "perf/step_flops", "perf/peak_flops", "perf/mfu"):
        assert step[key] > 0, key
    assert step["perf/mfu"] < 1
    assert (tmp_path / "xdg" / "fitrl" / "peak_flops.json").is_file()


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_tower_macs_equal_its_weights_per_patch(tmp_path, arch):
    """Without attention, a patch costs one MAC per weight of the patch embedding and the blocks'
    linears, and a merged token one per weight of each merger: counted on the real tiny towers."""
    from fitrl.models.families.qwen_vl import backbone
    from fitrl.models.tiny import make_tiny_model
    from transformers import AutoModelForImageTextToText

    path = make_tiny_model(tmp_path / arch, arch=arch)
    visual = backbone(AutoModelForImageTextToText.from_pretrained(path)).visual
    v = FlopsShape.from_config(json.loads((path / "config.json").read_text())).vision
    per_patch = sum(m.weight.numel() for n, m in visual.named_modules()
                    if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d)) and "merger" not in n)
    per_merged = sum(m.weight.numel() for n, m in visual.named_modules() if isinstance(m, torch.nn.Linear) and "merger" in n)
    patches = 64
    attended = [patches] * v.depth if v.window_patches is None else None
    attention = 2 * patches * v.hidden * sum(attended) if attended else None
    if attention is None:  # qwen2_5_vl: one full-attention block, the other windowed
        window = min(patches, v.window_patches)
        attention = 2 * patches * v.hidden * (patches * v.full_attention_blocks + window * (v.depth - v.full_attention_blocks))
    assert v.forward_flops(patches) == 2 * (patches * per_patch + patches // 4 * per_merged) + 2 * attention


@pytest.mark.parametrize("frozen,factor", [(False, 3), (True, 1)])
def test_step_perf_counts_the_vision_tower_over_each_sequences_images(tmp_path, frozen, factor):
    from fitrl.models.tiny import make_tiny_model
    from fitrl.trainer.perf import StepPerf, image_patches

    path = make_tiny_model(tmp_path / "vl", arch="qwen2_5_vl")
    batch = _rollout_batch([4, 2], [3, 1])
    batch.fields["multi_modal_inputs"] = [{"image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}, None]
    assert image_patches(batch) == [[16, 8], []]
    cfg = toy_config(path, "unused", "trainer.peak_flops=1e9", f"actor.model.freeze_vision_tower={frozen}")
    m = StepPerf(cfg).metrics(batch, {"rollout": [([4, 2], [3, 1])]}, {"rollout": 1.0, "old_logprob": 1.0,
                                                                          "update": 1.0})
    shape = FlopsShape.from_config(json.loads((path / "config.json").read_text()))
    text = shape.forward_flops(4, 3) + shape.forward_flops(2, 1)
    vision = shape.vision_flops([16, 8])
    # rollout and old log-prob: one forward each; the update: 3x the text, factor x the tower
    assert m["perf/step_flops"] == pytest.approx(2 * (text + vision) + 3 * text + factor * vision)


def test_step_perf_subtracts_the_prompt_copies_the_passes_skipped(tiny_model_dir):
    """Two prompts with 3 samples each (rows 0-2, 3-5). The passes report what they skipped
    (fitrl/ops/sharing.py): here the log-prob and update passes skipped rows 1 and 5's prompts
    (micro-batches of 2) and the decode loop's prefill rows 1, 2 and 5 (micro-batch 4)."""
    from fitrl.trainer.perf import StepPerf

    prompts, responses = [4, 4, 4, 2, 2, 2], [3, 1, 2, 2, 3, 1]
    batch = _rollout_batch(prompts, responses)
    shape = FlopsShape.from_config(TINY)
    times = {"rollout": 0.5, "old_logprob": 0.25, "update": 1.0}
    cfg = toy_config(tiny_model_dir, "unused", "trainer.peak_flops=1e9", "rollout.n=3", "actor.micro_batch_size=2",
                     "actor.logprob_micro_batch_size=2", "algorithm.fold_old_logprob=false", "actor.ppo_epochs=2")
    perf = StepPerf(cfg)
    plain = perf.metrics(batch, {"rollout": [(prompts, responses)]}, times)
    skipped = {"rollout": [4, 4, 2], "old_logprob": [4, 2], "update": [4, 2, 4, 2], "validation": [9]}
    shared = perf.metrics(batch, {"rollout": [(prompts, responses)]}, times, skipped)
    forward = sum(shape.forward_flops(p, r) for p, r in zip(prompts, responses))
    assert plain["perf/logprob_mfu"] == pytest.approx(forward / 0.25 / 1e9)
    assert shared["perf/logprob_mfu"] == pytest.approx((forward - shape.forward_flops(4, 0) - shape.forward_flops(2, 0))
                                                       / 0.25 / 1e9)
    # two epochs, each skipping rows 1 and 5: every skipped copy is reported, none multiplied
    update = 2 * 3 * forward - 2 * (shape.training_flops(4, 0) + shape.training_flops(2, 0))
    assert shared["perf/update_mfu"] == pytest.approx(update / 1.0 / 1e9)
    prefill = 2 * shape.forward_flops(4, 0) + shape.forward_flops(2, 0)
    assert shared["perf/rollout_mfu"] == pytest.approx((forward - prefill) / 0.5 / 1e9)
    assert shared["perf/update_tokens_per_s"] == plain["perf/update_tokens_per_s"]  # the user's tokens


def test_shared_passes_report_the_prompt_copies_they_skip(tiny_model_dir):
    """The real passes: a shared-prompt log-prob forward and the decode loop's prefill record the
    prompt lengths of the rows whose prompt another row ran, under the phase they run in; a plain
    forward, or one outside any phase, records nothing."""
    from fitrl.config.schema import FSDPConfig, ModelConfig, SamplingConfig
    from fitrl.data.batch import Batch
    from fitrl.models.loading import build_model, load_tokenizer
    from fitrl.ops.logprob import response_logprobs
    from fitrl.ops.sharing import SKIPPED_PROMPTS
    from fitrl.rollout.hf import HFRollout

    mcfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(mcfg)
    model = build_model("causal_lm", mcfg, FSDPConfig(), torch.device("cpu"))
    texts = ["What is 1 + 2?", "What is 7 + 5? Answer with a number."]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for t in texts]
    SKIPPED_PROMPTS.drain()
    engine = HFRollout(model, tok, micro_batch_size=4, decode="loop")
    with SKIPPED_PROMPTS.during("rollout"):  # 2 prompts x 3 samples, micro-batches of 4: rows 0-3, 4-5
        out = engine.generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=3, max_tokens=4))
    # micro-batch 1 holds prompt 0 three times and prompt 1 once; micro-batch 2 prompt 1 twice
    assert SKIPPED_PROMPTS.drain() == {"rollout": [len(ids[0]), len(ids[0]), len(ids[1])]}
    P = out["input_ids"].shape[1] - out["response_mask"].shape[1]
    args = (out["input_ids"], out["attention_mask"], out["position_ids"], out["response_mask"].shape[1])
    with SKIPPED_PROMPTS.during("old_logprob"):
        response_logprobs(model, *args, share_prompts=True)
        response_logprobs(model, *args, share_prompts=False)
    assert SKIPPED_PROMPTS.drain() == {"old_logprob": [len(ids[0])] * 2 + [len(ids[1])] * 2}
    response_logprobs(model, *args, share_prompts=True)  # outside a phase: not kept
    assert SKIPPED_PROMPTS.drain() == {} and P >= len(ids[1])
