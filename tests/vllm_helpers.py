"""Shared pieces of the vLLM tier (tests/test_vllm_*.py, marker ``vllm``, run in .venv-vllm by
``make test-vllm``): models vLLM's CPU backend can run, and a policy worker with either engine."""

from __future__ import annotations

import math

import torch

from fitrl.config import load_config
from fitrl.data.batch import Batch
from helpers import DATA, EXAMPLE

# vLLM 0.32's CPU attention has no kernel for the tiny models' 16-wide heads: the same sizes
# re-split into 32-wide heads
HEAD_DIM = 32


def make_vllm_model(out, arch: str = "qwen2", seed: int = 0):
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(out, arch=arch, size="tiny", seed=seed, head_dim=HEAD_DIM)


def vllm_config(model_dir, run_dir, *overrides):
    """The toy task on ``model_dir`` with the vLLM engine (sampling of the sampling-parity bar)."""
    return load_config(EXAMPLE, [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}",
        f"data.train_files=[{DATA / 'arith_train.jsonl'}]", f"data.val_files=[{DATA / 'arith_val.jsonl'}]",
        "trainer.progress_bar=false", "memory.plan=off", "rollout.engine=vllm", *overrides])


def prompts_from(worker, rows: int, tag: str = "p") -> Batch:
    """The first ``rows`` training prompts (cycled), tokenized as the trainer does."""
    from fitrl.trainer.run import build_datasets

    train, _ = build_datasets(worker.cfg, worker.tokenizer)
    return train.batch([i % len(train) for i in range(rows)], tag)


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs (temperature 1) of ``ids[1:]``: the reference for an engine's."""
    with torch.no_grad():
        x = torch.tensor([ids], device=next(model.parameters()).device)
        logp = model(x).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(-1, x[0, 1:, None]).squeeze(-1).cpu()


def ks_two_sample(a: list[float], b: list[float]) -> tuple[float, float]:
    """Kolmogorov-Smirnov statistic D and its asymptotic p-value (conservative for discrete
    samples: ties make D smaller, so a p-value from them is at least as large as reported)."""
    xs = sorted(set(a) | set(b))
    sa, sb = sorted(a), sorted(b)

    def cdf(sorted_values, x):
        lo, hi = 0, len(sorted_values)
        while lo < hi:
            mid = (lo + hi) // 2
            if sorted_values[mid] <= x:
                lo = mid + 1
            else:
                hi = mid
        return lo / len(sorted_values)

    d = max(abs(cdf(sa, x) - cdf(sb, x)) for x in xs)
    n = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 1.18:  # the series below converges slowly here: its dual form (Jacobi theta identity)
        if lam < 1e-3:
            return d, 1.0
        s = sum(math.exp(-((2 * k - 1) ** 2) * math.pi ** 2 / (8 * lam * lam)) for k in range(1, 101))
        return d, min(1.0, max(0.0, 1 - math.sqrt(2 * math.pi) / lam * s))
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))
