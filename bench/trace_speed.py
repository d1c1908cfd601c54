"""The planner's traced micro-steps on the meta device against FakeTensorMode: the same bytes, and how long each takes.

``fitrl.memory.trace`` traces a model's micro-steps (update forward and backward, no-grad
log-probs, generation's prefill) on a model of the real width and 2-3 layers, counting every
tensor storage the step creates. It does so on the ``meta`` device, made to take a CPU tensor's
memory paths; ``FakeTensorMode`` on a fake CPU, which it did before, is the reference. This
bench traces a matrix of specs both ways, in one process, after a warm-up trace of each (the
first trace in a process imports the model's module, which model loading would import anyway),
and prints every spec whose bytes differ (none is the claim) and the seconds per trace.

Shapes: Qwen2.5-7B's (hidden 3584, 28 heads over 4 KV heads, MLP 18944, vocabulary 152064),
the 31.7M model of ``bench/vs_trl.py`` (hidden 512, 8 heads over 4 KV heads, vocabulary 8192)
and small llama and qwen3 shapes; phases update (plain, gradient checkpointing, entropy in the
loss with small chunks, LoRA with dropout), log-probs and prefill; fp32, bf16 and fp16; sdpa and
eager attention. Nothing is allocated: the micro-batches are the sizes a real run plans.

    .venv/bin/python bench/trace_speed.py            # the whole matrix (about a minute)
    .venv/bin/python bench/trace_speed.py --quick    # the 7B and 31.7M update and prefill only
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from fitrl.config.roles import LoRAConfig  # noqa: E402
from fitrl.memory import trace  # noqa: E402
from fitrl.models.shape import ModelShape  # noqa: E402

SHAPES = {
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064),
    "qwen2-31.7M": dict(model_type="qwen2", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, intermediate_size=1408, vocab_size=8192),
    "llama-small": dict(model_type="llama", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=704, vocab_size=4096, tie_word_embeddings=True),
    "qwen3-small": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, intermediate_size=704, vocab_size=4096),
}
# (batch, prompt + response, response) per shape: a 7B micro-batch of 4 x 1,536, a bench step's 16 x 49
SIZES = {"qwen2.5-7b": (4, 1536, 1024), "qwen2-31.7M": (16, 49, 32), "llama-small": (8, 300, 200),
         "qwen3-small": (8, 300, 200)}
LORA = LoRAConfig(rank=16, dropout=0.05, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
UPDATES = {"plain": {}, "checkpointing": dict(checkpointing=True), "entropy, chunk 64": dict(entropy_grad=True, chunk=64),
           "lora": dict(lora=LORA)}


def specs(quick: bool):
    for name, cfg in SHAPES.items():
        if quick and name not in ("qwen2.5-7b", "qwen2-31.7M"):
            continue
        shape = ModelShape.from_dict(cfg)
        B, T, R = SIZES[name]
        for dtype, attn in itertools.product(("float32", "bfloat16", "float16"), ("sdpa", "eager")):
            if quick and (dtype == "float16" or attn == "eager"):
                continue
            for label, options in UPDATES.items():
                if quick and label != "plain":
                    continue
                yield (name, f"update {label}", dtype, attn,
                       trace.trace_spec(shape, phase="update", batch=B, seq_len=T, response_len=R, dtype=dtype,
                                        attn=attn, **options))
            if not quick:
                yield (name, "logprob", dtype, attn,
                       trace.trace_spec(shape, phase="logprob", batch=2 * B, seq_len=T, response_len=R, dtype=dtype,
                                        attn=attn))
            yield (name, "prefill", dtype, attn,
                   trace.trace_spec(shape, phase="prefill", batch=4 * B, seq_len=T - R, response_len=0, dtype=dtype,
                                    attn=attn))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 7B and 31.7M update and prefill only")
    args = parser.parse_args()

    warm = trace.trace_spec(ModelShape.from_dict(SHAPES["llama-small"]), phase="update", batch=2, seq_len=8,
                            response_len=4)
    for on in ("fake", "meta"):  # the first trace of each kind imports modules a run imports anyway
        trace._trace(warm, 2, on)
    seconds = {"fake": [], "meta": []}
    by_shape: dict[str, dict[str, list[float]]] = {}
    differ = 0
    for name, phase, dtype, attn, spec in specs(args.quick):
        peaks = {}
        for on in ("fake", "meta"):
            t = time.perf_counter()
            peaks[on] = trace._trace(spec, 2, on)
            took = time.perf_counter() - t
            seconds[on].append(took)
            by_shape.setdefault(name, {"fake": [], "meta": []})[on].append(took)
        if peaks["fake"] != peaks["meta"]:
            differ += 1
            print(f"DIFFERS {name} {phase} {dtype} {attn}: fake {peaks['fake']:,} meta {peaks['meta']:,} bytes")
    n = len(seconds["meta"])
    print(f"{n} traced micro-steps (2 layers each): {differ} differ in bytes between meta and fake")
    for name, s in by_shape.items():
        print(f"  {name:12} fake {statistics.median(s['fake']):.3f} s, meta {statistics.median(s['meta']):.3f} s "
              f"per trace (median of {len(s['meta'])}): {statistics.median(s['fake']) / statistics.median(s['meta']):.1f}x")
    print(f"  all          fake {sum(seconds['fake']):.1f} s, meta {sum(seconds['meta']):.1f} s in total: "
          f"{sum(seconds['fake']) / sum(seconds['meta']):.1f}x")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
