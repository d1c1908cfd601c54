"""Activations and logits traced on the meta device, against FakeTensorMode (fitrl.memory.trace)."""

import pytest
import torch

from fitrl.config.roles import LoRAConfig
from fitrl.models.shape import ModelShape
from fitrl.memory import trace
from fitrl.memory.live_bytes import StorageBytes
from fitrl.memory.trace import PLAIN_KV_DECODERS, _traced, kv_layer_bytes, trace_spec, transient_bytes


B, T, R = 4, 48, 32  # the real batch of the MemTracker checks


def _real_transient(tiny_model_dir, kind: str, step, pairs: bool = False) -> int:
    """MemTracker's peak beyond parameters, buffers and gradients while ``step(model, ids, mask,
    pos)`` runs on the real ``kind`` model (every gradient already there) and a left-padded batch,
    as in a rollout: the 4-D attention mask exists, as the trace assumes. ``pairs``: rows 0-1 and
    2-3 share their prompt (ids and padding), as a GRPO group's samples do, counted by the trace's
    own counter (:class:`~fitrl.memory.live_bytes.StorageBytes`, which agrees with MemTracker on
    the plain forward: the test below) on the real tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from fitrl.config.schema import FSDPConfig, ModelConfig
    from fitrl.models.loading import build_model

    model = build_model(kind, ModelConfig(path=str(tiny_model_dir)), FSDPConfig(), torch.device("cpu"))
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, ModelShape.from_path(tiny_model_dir).vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1:, :2] = 0
    if pairs:
        mask[1, :2] = 1
        ids[1, :T - R], ids[3, :T - R] = ids[0, :T - R], ids[2, :T - R]
    pos = torch.arange(T).expand(B, T)
    if pairs:  # MemTracker cannot follow a module called twice (the shared forward's two passes)
        tracker = StorageBytes()
        tracker.exclude([*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()), ids, mask, pos])
        with tracker:
            step(model, ids, mask, pos)
        return tracker.peak
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step(model, ids, mask, pos)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return peak["Total"] - sum(v for k, v in peak.items() if getattr(k, "value", k) in ("Parameter", "Buffer", "Gradient"))


def test_fake_trace_equals_memtracker_on_the_real_run(tiny_model_dir):
    """The fake trace's transient (fitrl.memory.live_bytes) equals PyTorch's MemTracker on the
    real model and a real left-padded batch (same code, same shapes; fake tensors only skip the
    arithmetic): within 0.1% and the batch's (B, T) int64 inputs, which MemTracker counts when a
    module receives them and the trace leaves to the plan's "batch" entry."""
    from fitrl.ops.logprob import response_logprobs

    def update(model, ids, mask, pos):
        logp, _ = response_logprobs(model, ids, mask, pos, R, chunk_size=64, with_entropy=True)
        (logp * torch.zeros(B, R)).sum().backward()

    real = _real_transient(tiny_model_dir, "causal_lm", update)
    shape = ModelShape.from_path(tiny_model_dir)
    spec = trace_spec(shape, phase="update", batch=B, seq_len=T, response_len=R, chunk=64)
    assert abs(transient_bytes(spec, shape.layers) - real) <= 1e-3 * real + 3 * B * T * 8


@pytest.mark.parametrize("phase", ["update", "logprob"])
def test_a_shared_prompt_trace_equals_memtracker_on_the_real_shared_forward(tiny_model_dir, phase):
    """``prompts`` groups: the trace runs the shared-prompt forward (fitrl/ops/shared_prompt.py)
    and counts what the real one holds when the batch's rows share two prompts, within the same
    tolerance as the plain forward above; and that is less than the plain forward's."""
    from fitrl.ops.logprob import response_logprobs

    def update(model, ids, mask, pos):
        if phase == "logprob":
            with torch.no_grad():
                response_logprobs(model, ids, mask, pos, R, chunk_size=64, with_entropy=True, share_prompts=True)
            return
        logp, _ = response_logprobs(model, ids, mask, pos, R, chunk_size=64, with_entropy=True, share_prompts=True)
        (logp * torch.zeros(B, R)).sum().backward()

    real = _real_transient(tiny_model_dir, "causal_lm", update, pairs=True)
    shape = ModelShape.from_path(tiny_model_dir)
    spec = trace_spec(shape, phase=phase, batch=B, seq_len=T, response_len=R, chunk=64, prompts=2)
    shared = transient_bytes(spec, shape.layers)
    assert abs(shared - real) <= 1e-3 * real + 3 * B * T * 8, (shared, real)
    plain = transient_bytes(trace_spec(shape, phase=phase, batch=B, seq_len=T, response_len=R, chunk=64),
                            shape.layers)
    assert shared < plain


def test_the_critics_update_trace_equals_memtracker_on_the_real_critic(tiny_model_dir):
    """PPO's critic (a token-classification head, fitrl.roles.critic.response_values and a loss
    over its values): the planner's ``value_update`` trace against MemTracker on the real model,
    as the policy's update above."""
    from fitrl.roles.critic import response_values

    def update(model, ids, mask, pos):
        micro = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -R:]}
        (response_values(model, micro) * torch.zeros(B, R)).sum().backward()

    real = _real_transient(tiny_model_dir, "value", update)
    shape = ModelShape.from_path(tiny_model_dir)
    spec = trace_spec(shape, phase="value_update", batch=B, seq_len=T, response_len=R)
    # within 1 % (0.7 % under here; the policy's update above is within 0.1 %)
    assert abs(transient_bytes(spec, shape.layers) - real) <= 1e-2 * real + 3 * B * T * 8


@pytest.mark.slow
def test_depth_extrapolation_matches_a_traced_deeper_model():
    """Two and three traced layers predict five: linear with autograd, constant without."""
    shape = ModelShape.from_dict(dict(model_type="qwen2", hidden_size=256, num_hidden_layers=5, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=704, vocab_size=4096))
    for phase, ckpt in (("update", False), ("update", True), ("logprob", False), ("prefill", False)):
        spec = trace_spec(shape, phase=phase, batch=4, seq_len=256, response_len=128, checkpointing=ckpt)
        assert transient_bytes(spec, 5) == _traced(spec, 5), (phase, ckpt)


@pytest.mark.parametrize("model_type", sorted(PLAIN_KV_DECODERS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_plain_decoders_prefill_grows_by_one_layers_kv(model_type, dtype):
    """What lets a deep model's prefill skip the 3-layer trace: from two traced layers to three the
    prefill grows by exactly one layer's K/V cache (GQA, a head dim of its own, tied or not)."""
    shape = ModelShape.from_dict(dict(model_type=model_type, hidden_size=192, num_hidden_layers=6, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=48, intermediate_size=320, vocab_size=3000,
                                      tie_word_embeddings=model_type == "llama"))
    from fitrl.config.roles import LoRAConfig

    for batch, prompt, lora in ((1, 7, None), (6, 300, None), (6, 300, LoRAConfig(rank=8, dropout=0.1))):
        spec = trace_spec(shape, phase="prefill", batch=batch, seq_len=prompt, response_len=0, dtype=dtype, lora=lora)
        assert _traced(spec, 3) - _traced(spec, 2) == kv_layer_bytes(spec) == 2 * 2 * 48 * batch * prompt * (
            4 if dtype == "float32" else 2)
        assert transient_bytes(spec, 6) == _traced(spec, 2) + 4 * kv_layer_bytes(spec)


def test_chunking_bounds_the_logits():
    """One chunk over a long micro-batch holds two (tokens, V) fp32 copies; 1,024-token chunks do not grow."""
    shape = ModelShape.from_dict(dict(model_type="qwen2", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=256, vocab_size=32768))
    one = transient_bytes(trace_spec(shape, phase="logprob", batch=4, seq_len=4096, response_len=4000,
                                     chunk=16000), 2)
    chunked = transient_bytes(trace_spec(shape, phase="logprob", batch=4, seq_len=4096, response_len=4000,
                                         chunk=1024), 2)
    assert one >= 2 * 16000 * 32768 * 4
    assert chunked < one / 5


_EQUAL_CASES = [  # (model type, phase, dtype, attention, options): every path the planner traces
    ("qwen2", "update", "float32", "sdpa", {}),
    ("qwen2", "update", "bfloat16", "sdpa", dict(checkpointing=True)),
    ("qwen2", "update", "float32", "sdpa", dict(entropy_grad=True, chunk=7)),
    ("qwen2", "update", "bfloat16", "sdpa", dict(lora=LoRAConfig(rank=4, dropout=0.1, target_modules=["q_proj", "v_proj"]))),
    ("qwen2", "update", "float16", "eager", {}),
    ("llama", "update", "bfloat16", "flash_attention_2", {}),
    ("qwen3", "update", "float32", "sdpa", dict(checkpointing=True)),
    ("qwen2", "logprob", "bfloat16", "sdpa", {}),
    ("qwen3", "logprob", "float32", "eager", {}),
    ("llama", "prefill", "float32", "sdpa", {}),
    ("qwen2", "values", "float32", "sdpa", {}),
    ("llama", "value_update", "bfloat16", "sdpa", dict(checkpointing=True)),
    ("qwen2", "prefill", "bfloat16", "sdpa", dict(lora=LoRAConfig(rank=4))),
    ("qwen2", "update", "float32", "sdpa", dict(prompts=2)),
    ("llama", "logprob", "bfloat16", "sdpa", dict(prompts=3)),
]


@pytest.mark.parametrize("model_type,phase,dtype,attn,options", _EQUAL_CASES)
def test_the_meta_trace_counts_the_fake_traces_bytes(model_type, phase, dtype, attn, options):
    """The meta trace (the planner's, 2-3x faster) takes a CPU tensor's paths (the 4-D mask built,
    sdpa's fused CPU kernel after a boolean mask turned additive) and so counts exactly the bytes
    of FakeTensorMode on a fake CPU, at two and three layers (bench/trace_speed.py: 144 more specs)."""
    shape = ModelShape.from_dict(dict(model_type=model_type, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                      tie_word_embeddings=model_type == "llama"))
    if phase == "prefill":
        spec = trace_spec(shape, phase=phase, batch=5, seq_len=13, response_len=0, dtype=dtype, attn=attn, **options)
    else:
        spec = trace_spec(shape, phase=phase, batch=5, seq_len=21, response_len=9, dtype=dtype, attn=attn, **options)
    for layers in (2, 3):
        assert trace._trace(spec, layers, "meta") == trace._trace(spec, layers, "fake"), layers


def test_a_model_that_reads_a_value_is_traced_fake(monkeypatch):
    """A forward that reads a tensor's value cannot run on meta (fake tensors let transformers see
    that they cannot be read): the trace falls back to fake tensors, and the bytes are theirs."""
    import contextlib

    shape = ModelShape.from_dict(dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=128, vocab_size=500))
    spec = trace_spec(shape, phase="logprob", batch=3, seq_len=11, response_len=4)
    fake = trace._trace(spec, 2, "fake")
    monkeypatch.setattr(trace, "_as_on_cpu", contextlib.nullcontext)  # transformers then reads the meta mask
    with pytest.raises(RuntimeError, match="meta"):
        trace._trace(spec, 2, "meta")
    _traced.cache_clear()
    assert _traced(spec, 2) == fake
