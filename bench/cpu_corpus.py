"""Host memory plan on CPU under glibc's default allocator, on configurations held out from calibration.

``bench/plan_accuracy.py`` set the planner's CPU constants (``fitrl/memory/calibration.py``); this
corpus checks them on runs that differ from those: llama and qwen2 families, three vocabularies
(512, 8,192, 16,384) and depths (2, 8, 12), n up to 16, a KL reference model, a critic (PPO, GAE),
two FSDP2 ranks with bf16 mixed precision (the Ray backend's rank code, gloo), one process with
bf16 autocast, token budgets, gradient checkpointing, long responses. Each configuration runs
the real workers in fresh processes with the default allocator (no ``MALLOC_*`` variable), as
:func:`bench.plan_accuracy.rank_main` does: a warm-up step, then the second step's phases, each
one's peak RSS (``VmHWM`` after ``clear_refs``; rank maximum).

A measured phase is compared with the planned phase that holds it: the critic's values with
``old_logprob``, its update with ``update`` (the planner's phases hold every role's part of a
step); where two measured phases map to one planned phase the larger counts. The fit-deciding
peak of a configuration is its largest phase, measured against predicted over the same phases;
an under-prediction there is what would let a plan say "fits" for a run that does not.

    .venv/bin/python bench/cpu_corpus.py                         # the corpus, default allocator
    .venv/bin/python bench/cpu_corpus.py --only 0 5 --json rows.json
    .venv/bin/python bench/cpu_corpus.py --set memory.trim_heap=false   # the runs without trimming
    .venv/bin/python bench/cpu_corpus.py --allocator jemalloc    # ranks preloaded (`make allocators`)
    .venv/bin/python bench/cpu_corpus.py --replan rows.json      # those measurements, today's plan
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import GIB, PLAN_PHASES, Case, measure, model_dirs, predict  # noqa: E402

# size, ranks, prompts, n, P, R, micro, ckpt, chunk, then the keyword fields; none of these is a
# configuration of bench/plan_accuracy.py
CORPUS = [
    Case("small", 1, 2, 16, 16, 32, 16, False, 1024, arch="llama", rollout=True),            # n=16
    Case("deep", 1, 2, 4, 64, 192, 4, False, 1024),                                          # vocab 16k
    Case("deep", 1, 2, 4, 64, 192, 4, True, 256, arch="llama"),                              # depth 12, ckpt
    Case("small", 1, 2, 4, 32, 96, 4, False, 1024, kl=True),                                 # reference model
    Case("small", 1, 2, 4, 32, 96, 4, False, 1024, arch="llama", critic=True),               # PPO
    Case("small", 2, 2, 4, 32, 192, 4, False, 1024, mixed=True),                             # FSDP2 + bf16
    Case("deep", 2, 2, 8, 32, 128, 4, True, 1024, arch="llama", mixed=True),                 # FSDP2 + bf16, ckpt
    Case("deep", 1, 1, 16, 32, 96, 16, False, 1024, budget=1024),                            # token budget
    Case("deep", 1, 1, 4, 32, 640, 2, False, 1024, arch="llama"),                            # long responses
    Case("deep", 1, 2, 4, 32, 96, 4, False, 1024, kl=True, critic=True, rollout=True),       # KL + PPO
    Case("tiny", 1, 8, 16, 32, 128, 32, False, 1024, arch="llama"),                          # vocab 512, n=16
    Case("small", 1, 2, 4, 32, 128, 4, False, 1024, arch="llama", mixed=True),               # bf16 autocast
    Case("small", 2, 2, 8, 32, 128, 8, True, 1024, budget=640),                              # FSDP2, budget, ckpt
    Case("deep", 1, 1, 16, 32, 64, 8, False, 256, arch="llama"),                             # n=16, chunks
]


def planned(case: Case, measured: dict, predicted: dict) -> dict[str, tuple[int, int]]:
    """planned phase -> (predicted, measured): the larger of the measured phases it holds."""
    out: dict[str, tuple[int, int]] = {}
    for phase in case.phases:
        name = PLAN_PHASES[phase]
        out[name] = (predicted[phase], max(measured[phase], out.get(name, (0, 0))[1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="indices of CORPUS to run")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every run and its plan")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--allocator", default="glibc", choices=["glibc", "jemalloc", "tcmalloc"],
                        help="the ranks' host allocator, preloaded as memory.host_allocator does; the plan "
                             "is made with that setting")
    parser.add_argument("--replan", metavar="JSON",
                        help="no runs: the measurements of an earlier --json, planned again with today's planner "
                             "(its configurations, settings and allocator)")
    args = parser.parse_args()
    earlier = json.loads(Path(args.replan).read_text()) if args.replan else None
    if earlier is not None:
        args.only = sorted({r["case"] for r in earlier["phases"]})
        args.set, args.allocator = earlier["settings"], "glibc"  # (its settings name the allocator already)
    if args.allocator != "glibc":
        from fitrl.core.allocator import find_library

        library = find_library(args.allocator)
        if library is None:
            sys.exit(f"no {args.allocator} library found: run `make allocators`")
        os.environ["LD_PRELOAD"] = str(library)  # the spawned ranks inherit it; this process has glibc's
        args.set = [*args.set, f"memory.host_allocator={args.allocator}"]
    cases = [(i, dataclasses.replace(CORPUS[i], extra=tuple(args.set)))
             for i in (args.only if args.only else range(len(CORPUS)))]
    rows, fits = [], []
    print(f"{'#':>2} {'configuration':<88} {'phase':<11} {'predicted':>9} {'measured':>9} {'error':>7} {'s':>6}",
          flush=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs([c for _, c in cases], tmp)
        for i, case in cases:
            pred = predict(case, dirs[case.arch, case.size], "glibc")
            if earlier is None:
                meas = measure(case, dirs[case.arch, case.size], port=29800 + i, malloc="glibc")
                seconds = {PLAN_PHASES[p]: 0.0 for p in case.phases}
                for p in case.phases:
                    seconds[PLAN_PHASES[p]] += meas["seconds"][p]
                per_phase = planned(case, meas, pred)
            else:
                rows_before = [r for r in earlier["phases"] if r["case"] == i]
                seconds = {r["phase"]: r["seconds"] for r in rows_before}
                by_name = {PLAN_PHASES[p]: pred[p] for p in case.phases}
                per_phase = {r["phase"]: (by_name[r["phase"]], round(r["measured_gib"] * GIB)) for r in rows_before}
            for phase, (p, m) in per_phase.items():
                rows.append({"case": i, "label": case.label, "phase": phase, "predicted_gib": p / GIB,
                             "measured_gib": m / GIB, "error": (p - m) / m, "seconds": seconds[phase]})
                print(f"{i:>2} {case.label:<88} {phase:<11} {p / GIB:9.3f} {m / GIB:9.3f} {(p - m) / m:+7.1%} "
                      f"{seconds[phase]:6.1f}", flush=True)
            p_max = max(p for p, _ in per_phase.values())
            m_max = max(m for _, m in per_phase.values())
            fits.append({"case": i, "predicted_gib": p_max / GIB, "measured_gib": m_max / GIB,
                         "error": (p_max - m_max) / m_max})
            print(f"{i:>2} {'fit-deciding peak':<88} {'max':<11} {p_max / GIB:9.3f} {m_max / GIB:9.3f} "
                  f"{(p_max - m_max) / m_max:+7.1%}", flush=True)
    errs = [abs(r["error"]) for r in rows]
    fit_errs = [abs(f["error"]) for f in fits]
    under = [f for f in fits if f["error"] < 0]
    print(f"{len(errs)} phase peaks of {len(fits)} configurations: mean |error| {sum(errs) / len(errs):.1%}, "
          f"worst {max(errs):.1%}; fit-deciding peaks: mean |error| {sum(fit_errs) / len(fit_errs):.1%}, "
          f"worst {max(fit_errs):.1%}, under-predicted {len(under)} "
          f"({', '.join('#%d %+.1f%%' % (f['case'], 100 * f['error']) for f in under) or 'none'}); "
          f"{time.perf_counter() - began:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": args.set, "allocator": args.allocator, "phases": rows,
                                               "fit": fits}, indent=2))
    sys.exit(0 if not under and sum(errs) / len(errs) <= 0.07 else 1)


if __name__ == "__main__":
    main()
