"""Does ``torch.compile`` make fitrl's update faster? The training forward + backward of
``response_logprobs`` (what ``Actor.update`` runs per micro-batch), eager against the decoder
layers compiled (``nn.Module.compile``, inductor, dynamic shapes: micro-batches differ in length),
alternating, on the shapes of bench/vs_trl.py.

    .venv/bin/python bench/compile_probe.py                         # 0.64M and 31.7M, fp32, 2 threads
    .venv/bin/python bench/compile_probe.py --shapes 0.64M --threads 1 --iters 20

Per shape it prints the first compiled call (the compile cost, paid again at each new shape
bucket), then the median seconds per forward + backward of each mode over ``--iters`` calls with
lengths varying as real micro-batches do, and the ratio. fitrl adds a compile option only where
this wins (issue 13: "torch.compile where it measurably helps, off by default unless it wins").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import build_model  # noqa: E402


def batch(vocab: int, rows: int, prompt: int, response: int, generator: torch.Generator):
    """A left-padded prompt + right-padded response batch, as the rollout makes."""
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=generator)
    for r, n in enumerate(lengths.tolist()):
        mask[r, prompt + n:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions, response


def step(model, data) -> None:
    from fitrl.ops.logprob import response_logprobs

    ids, mask, positions, response = data
    logp, _ = response_logprobs(model, ids, mask, positions, response)
    logp.sum().backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.64M", "31.7M"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--rows", type=int, default=16, help="sequences per micro-batch (bench/vs_trl.py's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.gettempdir()) / "fitrl-compile-probe"
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} rows x (23 prompt + <= 32 response)")
    for label in args.shapes:
        path, info = build_model(work, label)
        eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        compiled = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        for layer in compiled.model.layers:
            layer.compile(dynamic=True)
        g = torch.Generator().manual_seed(0)
        data = [batch(info["vocab_size"], args.rows, 23, r, g) for r in (32, 28, 32, 30)]
        t0 = time.perf_counter()
        step(compiled, data[0])
        first = time.perf_counter() - t0
        step(eager, data[0])
        for d in data[1:]:  # later lengths: recompiles with dynamic shapes, if any, happen here
            step(compiled, d)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for i in range(args.iters):
            d = data[i % len(data)]
            for name, model in (("eager", eager), ("compiled", compiled))[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                step(model, d)
                times[name].append(time.perf_counter() - t0)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"{label} ({info['params'] / 1e6:.2f}M params): first compiled call {first:.1f} s; "
              f"forward+backward eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms, compiled/eager {c / e:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
