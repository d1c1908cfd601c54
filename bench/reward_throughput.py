"""Math reward throughput: 1,000 samples scored in the driver (serial) vs in the worker pool.

Workload: the built-in ``math`` reward (boxed/marker extraction + math-verify) over 1,000
distinct (response, answer) pairs, a deterministic mix of integers with text around them,
fractions vs decimals, radicals, intervals, sets and wrong answers. Both sides are warmed
first (sympy imported, workers started); worker start-up is reported separately. ``cpu s`` is
driver + worker CPU time of the reported pass: on a shared machine wall-clock figures move with
other load, CPU seconds much less.

    .venv/bin/python bench/reward_throughput.py                  # serial, then pools of 2 and 4 workers
    .venv/bin/python bench/reward_throughput.py --workers 2 8 16 --passes 1
"""

from __future__ import annotations

import argparse
import os
import random
import time

import psutil
import torch

from fitrl.config.schema import RewardConfig
from fitrl.roles.reward import RewardScorer


def make_samples(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Pairs whose verdicts vary; about half correct."""
    rng = random.Random(seed)
    responses, answers = [], []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        right = rng.random() < 0.5
        kind = i % 6
        if kind == 0:      # integer with text around it, after a marker
            gold, pred = str(a * b), str(a * b if right else a * b + 1)
            text = f"First {a} times {b}. Multiplying gives {pred}.\nThe answer is {pred} apples."
        elif kind == 1:    # fraction vs decimal
            gold, pred = rf"\frac{{{a}}}{{{b}}}", f"{a / b:.7f}" if right else f"{a / b + 0.01:.7f}"
            text = rf"Dividing, we get \boxed{{{pred}}}"
        elif kind == 2:    # \frac vs /
            gold, pred = f"{a}/{b}", rf"\dfrac{{{a}}}{{{b}}}" if right else rf"\dfrac{{{b}}}{{{a}}}"
            text = rf"So $x = {pred}$, i.e. \boxed{{{pred}}}."
        elif kind == 3:    # radicals
            gold, pred = rf"{a}\sqrt{{{b}}}", rf"\sqrt{{{a * a * b}}}" if right else rf"\sqrt{{{a * b}}}"
            text = rf"Simplify: $\boxed{{{pred}}}$"
        elif kind == 4:    # intervals
            lo, hi = min(a, b), max(a, b) + 1
            gold, pred = f"({lo}, {hi}]", f"({lo},{hi}]" if right else f"[{lo},{hi}]"
            text = rf"The solution set is \boxed{{{pred}}}"
        else:              # sets
            gold = rf"\{{{a}, {b}\}}"
            pred = rf"\{{{b},{a}\}}" if right else rf"\{{{a},{b + 1}\}}"
            text = rf"Final answer: $\boxed{{{pred}}}$"
        responses.append(text)
        answers.append(gold)
    return responses, answers


def run(num_workers: int, samples: list[tuple[list[str], list[str]]], timeout: float) -> dict:
    """Best of the passes (each on fresh samples: math-verify caches parses), with its CPU seconds."""
    cfg = RewardConfig("math", num_workers=num_workers, timeout=timeout)
    t0 = time.perf_counter()
    with RewardScorer(cfg) as scorer:
        scorer.score([r"\boxed{1}"], ["1"])                       # workers up, sympy imported
        startup = time.perf_counter() - t0
        procs = [psutil.Process()] + [psutil.Process(w.proc.pid) for w in (scorer.pool._workers if scorer.pool else [])]
        best, all_scores = None, []
        for responses, answers in samples:
            cpu0, t1 = _cpu(procs), time.perf_counter()
            scores = scorer.score(responses, answers).scores
            elapsed, cpu = time.perf_counter() - t1, _cpu(procs) - cpu0
            all_scores.append(scores)
            m = scorer.last_metrics
            if best is None or elapsed < best["seconds"]:
                best = {"workers": num_workers, "startup_s": startup, "seconds": elapsed, "cpu_s": cpu,
                        "samples_per_s": len(responses) / elapsed, "timeouts": m["reward/timeouts"],
                        "errors": m["reward/errors"]}
    best["scores"] = torch.cat(all_scores)
    return best


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--passes", type=int, default=3, help="timed passes per mode; the fastest is reported")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    samples = [make_samples(args.samples, seed=i) for i in range(args.passes)]
    print(f"{args.samples} math samples, best of {args.passes} passes; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at start; built-in 'math' reward")
    rows = [run(w, samples, args.timeout) for w in [0, *args.workers]]
    base = rows[0]["samples_per_s"]
    print(f"{'mode':<12}{'samples/s':>11}{'seconds':>9}{'cpu s':>8}{'speed-up':>10}{'start-up s':>12}"
          f"{'timeouts':>10}{'errors':>8}  scores")
    for r in rows:
        mode = "serial" if r["workers"] == 0 else f"pool x{r['workers']}"
        same = "mean %.3f" % r["scores"].mean() if r is rows[0] else (
            "= serial" if torch.equal(r["scores"], rows[0]["scores"]) else "DIFFER from serial")
        print(f"{mode:<12}{r['samples_per_s']:>11.0f}{r['seconds']:>9.2f}{r['cpu_s']:>8.2f}"
              f"{r['samples_per_s'] / base:>9.2f}x{r['startup_s']:>12.2f}{r['timeouts']:>10.0f}"
              f"{r['errors']:>8.0f}  {same}")


if __name__ == "__main__":
    main()
