"""fitrl against TRL's GRPOTrainer (1.16.0) on the same GRPO work, side by side.

    make bench-trl                                     # builds .venv-bench (TRL beside fitrl), runs the defaults
    .venv-bench/bin/python bench/vs_trl.py --shapes 0.64M --precision fp32 --threads 2 --steps 6 --repeats 1
    .venv-bench/bin/python bench/vs_trl.py --shapes 0.64M 31.7M --precision fp32 bf16 --threads 1 2 \\
        --steps 40 --repeats 3 --seeds 1 2 --json /tmp/vs_trl.json
    .venv-bench/bin/python bench/vs_trl.py --shapes 0.64M --precision fp32 --threads 1 --steps 6 --repeats 3 \
        --cold-plan                                    # every fitrl run a config's first launch (plan traced)

Every run is a fresh process (so process wall, start-up and peak RSS belong to that run alone);
fitrl and TRL runs alternate, the side that goes first swapping at every repeat. Per cell (shape x
precision x threads) and side it prints, as the median over runs: seconds per step (median of the
step-end to step-end intervals after ``--warmup`` steps: everything the loop does per step,
logging included), process wall, start-up (process start to the first step's begin and end),
tokens/s per phase (generated tokens / generation seconds; prompt + response tokens / update
seconds; prompt + response tokens / step), peak RSS of the process tree (sampled every 50 ms with
psutil), the mean reward per 10-step block (mean over runs), and the ratios fitrl/TRL. It also
measures this machine's matmul peak (a large ``torch.mm``, fp32 and bf16, at each thread count, twice;
bf16's is the faster of torch's own bf16 mm and the one fitrl runs, fitrl/core/bf16_matmul.py)
and prints the achieved FLOP/s of fitrl's update phase against it (``perf/update_mfu`` x
``perf/peak_flops``; docs/metrics.md). TRL's phase times come from wrapping its
``_generate_single_turn`` (generation), ``_generate_and_score_completions`` (generation, decoding,
reward, advantages) and ``training_step``; its update time is the step's training-step time less
that (forward, backward and optimizer step).

The same work on both sides:

- the same model directory (built once here by fitrl's tiny-model builder, random weights, qwen2),
  the same prompt rows (examples/data/arith_train.jsonl, the toy task of examples/arith.yaml,
  rendered as one user message through the model's chat template on both sides), fitrl's ``arith``
  rule reward (TRL calls the same function on the same decoded text, via fitrl's
  ``resolve_reward_fn``);
- 8 prompts x 8 samples per step in one ``generate`` call, up to 32 new tokens stopping at EOS,
  temperature 1.0, top-k 0 (off; examples/arith.yaml's 50 is overridden), top-p 1.0;
- GRPO advantages (group mean and std), PPO clip 0.2, no KL (fitrl: no reference model; TRL:
  ``beta=0``), no entropy bonus, token-mean loss over the whole step's tokens (fitrl
  ``token-mean``; TRL ``loss_type="dapo"``, which divides by the active tokens of the whole
  accumulated batch: in 1.16 ``bnpo`` divides by the tokens of each micro-batch, ``grpo`` per
  sequence);
- one optimizer step per RL step: fitrl ``actor.mini_batch_size=8`` prompts; TRL
  ``per_device_train_batch_size=--micro-batch`` sequences, ``gradient_accumulation_steps =
  steps_per_generation = 64 / micro-batch``, so ``generation_batch_size=64`` and one generation
  feeds exactly one optimizer step, ``num_iterations=1``; the same micro-batch of sequences per
  forward/backward on both sides;
- neither runs a separate old-log-prob pass: fitrl's ``algorithm.fold_old_logprob`` (default) and
  TRL (on-policy: ``old_per_token_logps`` is the detached current log-prob) both take the ratio's
  denominator from the update's own forward;
- the same arithmetic result, not the same operations: fitrl's defaults run a prompt shared by
  rows of a micro-batch once (``actor.share_prompts``; its decode loop prefills each prompt once),
  where TRL runs each of a prompt's 8 copies (docs/architecture.md, "Throughput"); the log-probs
  and gradients agree to rounding (tests/test_shared_prompt.py). ``--fitrl-set
  actor.share_prompts=false rollout.decode=generate`` runs fitrl without either;
- AdamW, each side's default kernel (fitrl: torch's fused kernel, ``actor.optim.fused``; TRL
  ``optim="adamw_torch"``: torch's foreach one; the same update within rounding), lr 1e-3 constant, no warm-up (TRL's
  default linear decay is switched off), betas 0.9/0.999, eps 1e-8, no weight decay, gradient
  clipping at norm 1.0; fp32 weights; ``--precision bf16``: TRL ``bf16=True`` (autocast),
  fitrl ``actor.fsdp.mixed_precision=true`` (autocast in the single-process backend; on a CPU
  without bf16 GEMM kernels its bf16 products run in the fp32 kernel on the bf16 operands and
  are rounded once, fitrl/core/bf16_matmul.py, where TRL's run in torch's bf16 kernel); no
  gradient checkpointing (TRL's default is on: switched off), sdpa attention;
- no validation, no checkpoint (fitrl ``checkpoint.save_final=false``; TRL
  ``save_strategy="no"``), no generation samples logged, no progress bar, metrics every step
  (fitrl metrics.jsonl + its console line, to a log file; TRL ``logging_steps=1``, ``report_to``
  none), the same seed (``trainer.seed``; TRL ``seed``/``data_seed``: the prompt order and the
  samples still differ, the two samplers being different code);
- threads: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` in both processes' environment, and
  ``torch.set_num_threads`` (fitrl ``trainer.num_threads``; TRL's process calls it);
  ``TOKENIZERS_PARALLELISM=false`` on both; offline (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``,
  ``HF_DATASETS_OFFLINE``, W&B disabled).

What fitrl does that TRL does not, and whether it is left on:

- reward scoring runs in the driver (``reward.num_workers=0``), as TRL calls it in-process: the
  worker pool (fitrl's default, a time limit per call) would add two processes to the tree's RSS;
- left on, as part of what fitrl costs: the memory plan before loading (``memory.plan``), per-phase
  memory telemetry and the guard, divergence checks, ``perf/*`` metrics (its CPU peak benchmark
  is cached in ~/.cache/fitrl after the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SIDES = ROOT / "bench" / "vs_trl_sides.py"
# what each side generates and learns with (the same on both): --task
TASKS = {"throughput": {"max_new": 32, "top_k": 0, "lr": 1e-3},
         "curve": {"max_new": 8, "top_k": 50, "lr": 2e-3}}
DATA = ROOT / "examples" / "data" / "arith_train.jsonl"

# Shapes: a size of fitrl's tiny-model builder (fitrl/models/tiny.py SIZES) plus overrides of its
# row. The labels are the issue's; the parameter count actually built is printed.
SHAPES: dict[str, tuple[str, dict]] = {
    "0.64M": ("tiny", {"vocab_size": 8192}),  # tiny's 2 layers of width 64, small's 8192-token vocabulary (tied)
    "31.7M": ("small", {}),                   # 8 layers of width 512, 8192 vocabulary, untied head
    "tiny": ("tiny", {}), "small": ("small", {}), "medium": ("medium", {}),
}


def build_model(work: Path, label: str) -> tuple[Path, dict]:
    """The shape's model directory under ``work`` (built once; deterministic) and its description."""
    from fitrl.models import tiny

    out = work / "models" / f"qwen2-{label}"
    if not (out / "config.json").is_file():
        size, extra = SHAPES[label]
        name = size if not extra else f"vs-trl-{label}"
        tiny.SIZES[name] = dict(tiny.SIZES[size], **extra)
        tiny.make_tiny_model(out, arch="qwen2", size=name, seed=0)
    return out, tiny.describe(out)


def run_child(spec: dict, env: dict) -> dict:
    """Run one side in a fresh process; the process wall, start-up and tree RSS measured from here."""
    Path(spec["result"]).unlink(missing_ok=True)
    spec_file = Path(spec["result"]).with_suffix(".spec.json")
    spec_file.write_text(json.dumps(spec))
    peak, done = [0], threading.Event()
    with open(Path(spec["result"]).with_suffix(".stderr"), "w") as stderr:
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, str(SIDES), str(spec_file)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr)

    def sample() -> None:  # sum of RSS over the child and its descendants, every 50 ms
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            peak[0] = max(peak[0], total)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    wall = time.time() - t0
    done.set()
    sampler.join()
    path = Path(spec["result"])
    result = json.loads(path.read_text()) if path.is_file() else {"error": f"exit status {rc}, no result"}
    result.update(rc=rc, wall_s=wall, peak_rss_gib=peak[0] / 2 ** 30, t0=t0)
    return result


def cold_cache(work: Path, name: str, env: dict) -> dict:
    """``env`` with a fitrl cache directory of the run's own, empty but for the measured matmul peak
    (fitrl/core/cache.py): the plan and its traces are made anew, as at a config's first launch."""
    from fitrl.core.cache import cache_root

    cache = work / "runs" / f"{name}.cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    peak = cache_root() / "peak_flops.json"
    if peak.is_file():
        shutil.copy(peak, cache / peak.name)
    return dict(env, FITRL_CACHE_DIR=str(cache))


def summarise(run: dict, warmup: int) -> dict:
    """One run's figures (medians over the steps after ``warmup``)."""
    begin, end, steps = run["events"]["step_begin"], run["events"]["step_end"], run["steps"]
    intervals = [end[0] - begin[0]] + [b - a for a, b in zip(end, end[1:])]
    timed = range(min(warmup, len(end) - 1), len(end))

    def med(key: str):
        vals = [steps[i][key] for i in timed if i < len(steps) and steps[i].get(key) is not None]
        return statistics.median(vals) if vals else None

    s = {
        "s_per_step": statistics.median(intervals[i] for i in timed),
        "wall_s": run["wall_s"], "startup_begin_s": begin[0] - run["t0"], "startup_end_s": end[0] - run["t0"],
        "rollout_s": med("time/rollout"), "update_s": med("time/update"),
        "gen_tok_s": med("perf/rollout_tokens_per_s"), "update_tok_s": med("perf/update_tokens_per_s"),
        "peak_rss_gib": run["peak_rss_gib"],
        "response_len": statistics.fmean(st["response/length_mean"] for st in steps),
        "rewards": [s["reward/mean"] for s in steps],
    }
    tok = [steps[i]["tokens"] / intervals[i] for i in timed if i < len(steps) and steps[i].get("tokens")]
    s["step_tok_s"] = statistics.median(tok) if tok else None
    tokens = [st["tokens"] for st in steps if st.get("tokens")]  # 64 sequences a step
    s["prompt_len"] = statistics.fmean(tokens) / 64 - s["response_len"] if tokens else None
    flops = [steps[i]["perf/update_mfu"] * steps[i]["perf/peak_flops"] for i in timed
             if i < len(steps) and "perf/update_mfu" in steps[i] and "perf/peak_flops" in steps[i]]
    s["update_flops"] = statistics.median(flops) if flops else None
    return s


def blocks(rewards: list[float], size: int = 10) -> list[float]:
    return [statistics.fmean(rewards[i:i + size]) for i in range(0, len(rewards), size)]


ROWS = [  # (label, key, format)
    ("s/step", "s_per_step", "{:.3f}"), ("process wall s", "wall_s", "{:.1f}"),
    ("start-up to step 1 begin s", "startup_begin_s", "{:.1f}"), ("start-up to step 1 end s", "startup_end_s", "{:.1f}"),
    ("generate s/step", "rollout_s", "{:.3f}"), ("update s/step", "update_s", "{:.3f}"),
    ("generated tok/s", "gen_tok_s", "{:,.0f}"), ("update tok/s (prompt+resp)", "update_tok_s", "{:,.0f}"),
    ("step tok/s (prompt+resp)", "step_tok_s", "{:,.0f}"), ("peak RSS GiB (tree)", "peak_rss_gib", "{:.2f}"),
    ("response tokens/sequence", "response_len", "{:.1f}"), ("prompt tokens/sequence", "prompt_len", "{:.1f}"),
]


def print_cell(title: str, runs: dict[str, list[dict]], peak: dict, precision: str) -> None:
    print(f"\n== {title}")
    fit = [r for r in runs["fitrl"] if "error" not in r]
    trl = [r for r in runs["trl"] if "error" not in r]
    for side, rs in runs.items():
        for r in rs:
            if "error" in r:
                why = "fitrl bf16 unsupported" if side == "fitrl" and precision == "bf16" else f"{side} run failed"
                print(f"{why}: {r['error']}")
    if not fit and not trl:
        return
    med = {side: {k: (statistics.median(v) if (v := [s[k] for s in ss if s[k] is not None]) else None)
                  for k in ss[0] if k != "rewards"} if ss else {}
           for side, ss in (("fitrl", fit), ("trl", trl))}
    print(f"{'':28} {'fitrl':>10} {'TRL':>10} {'fitrl/TRL':>10}   (median over {len(fit)} + {len(trl)} runs)")
    for label, key, fmt in ROWS:
        a, b = med["fitrl"].get(key), med["trl"].get(key)
        cells = [fmt.format(x) if x is not None else "-" for x in (a, b)]
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        print(f"{label:28} {cells[0]:>10} {cells[1]:>10} {ratio:>10}")
    for side, ss in (("fitrl", fit), ("TRL", trl)):
        if ss:
            curve = blocks([statistics.fmean(x) for x in zip(*(s["rewards"] for s in ss))])
            print(f"reward per 10-step block, {side:5}: " + " ".join(f"{x:.3f}" for x in curve))
    flops = med["fitrl"].get("update_flops")
    if flops and peak.get(precision):
        share = flops / 1e9 / peak[precision]
        # above 100 %: the large torch.mm was slower than the model's own matmuls, so it is no peak
        caveat = (f"; not a peak here: its large {precision} mm ran slower than the model's" if share > 1 else "")
        print(f"fitrl update: {flops / 1e9:.1f} GFLOP/s achieved = {share:.1%} of this "
              f"machine's {precision} matmul peak ({peak[precision]:.1f} GFLOP/s){caveat}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.64M", "31.7M"], choices=list(SHAPES))
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[2])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the s/step and tok/s medians")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side per seed")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--micro-batch", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64],
                        help="sequences per forward/backward on both sides (64 per step)")
    parser.add_argument("--fitrl-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra dotted overrides for the fitrl side (e.g. algorithm.fold_old_logprob=false)")
    parser.add_argument("--task", default="throughput", choices=list(TASKS),
                        help="throughput: <= 32 new tokens, full-vocabulary sampling (the timing cells); "
                             "curve: the demo's sampling (<= 8 new tokens, top-k 50, lr 2e-3), where a "
                             "random-initialised model's reward can rise within 100 steps")
    parser.add_argument("--work-dir", default=str(ROOT / ".cache" / "bench-vs-trl"))
    parser.add_argument("--json", help="also write every run's raw record here")
    parser.add_argument("--sides", nargs="+", default=["fitrl", "trl"], choices=["fitrl", "trl"],
                        help="the sides to run; the other side's runs are read from --reuse")
    parser.add_argument("--cold-plan", action="store_true",
                        help="every fitrl run starts with empty plan and trace caches (a config's first launch: "
                             "its pre-flight plan traces its micro-steps); this machine's cached matmul peak is kept")
    parser.add_argument("--reuse", metavar="JSON", help="an earlier --json holding the runs of the sides not "
                        "in --sides (one side re-measured against a slow side measured once)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")

    work = Path(args.work_dir)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                    WANDB_MODE="disabled", WANDB_DISABLED="true", TOKENIZERS_PARALLELISM="false")
    import torch
    import transformers
    import trl

    task = TASKS[args.task]

    print(f"fitrl vs TRL {trl.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{os.cpu_count()} CPUs; 8 prompts x 8 samples, <= {task['max_new']} new tokens (EOS stops), top-k "
          f"{task['top_k'] or 'off'}, lr {task['lr']:g}, no KL, "
          f"token-mean, micro-batch {args.micro_batch}; {args.steps} steps, medians after {args.warmup}; "
          f"{args.repeats} repeat(s) x seeds {args.seeds}")
    models = {label: build_model(work, label) for label in args.shapes}
    for label, (path, info) in models.items():
        print(f"shape {label}: {info['params'] / 1e6:.3f}M params (qwen2, hidden {info['hidden_size']}, "
              f"{info['num_layers']} layers, vocab {info['vocab_size']}, tied {info['tie_word_embeddings']}) {path}")
    peaks = {}
    for threads in args.threads:
        env = dict(base_env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        # twice, each product's best kept: one sitting measured 87.3 GFLOP/s at 2 threads where the
        # next command measured 168.6 (a core taken for the whole second), and every share with it
        tries = [run_child({"side": "matmul", "threads": threads,
                            "result": str(work / "runs" / f"matmul-{threads}-{i}.json")}, env) for i in range(2)]
        res = {k: max((t[k] for t in tries), key=lambda v: v["gflops"]) for k in ("fp32", "bf16", "bf16_fitrl")}
        # bf16's peak: the faster of torch's own bf16 mm and the one fitrl runs (widened to fp32 on
        # a CPU without bf16 kernels: fitrl/core/bf16_matmul.py), the best bf16 product here
        peaks[threads] = {"fp32": res["fp32"]["gflops"],
                          "bf16": max(res["bf16"]["gflops"], res["bf16_fitrl"]["gflops"])}
        print(f"matmul peak at {threads} thread(s): " + ", ".join(
            f"{k} {v['gflops']:.1f} GFLOP/s (n={v['n']})" for k, v in res.items() if k in ("fp32", "bf16", "bf16_fitrl")))

    reused = {r["run"]: r for r in json.loads(Path(args.reuse).read_text())["runs"]} if args.reuse else {}
    record = []
    for label in args.shapes:
        for precision in args.precision:
            for threads in args.threads:
                env = dict(base_env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
                runs: dict[str, list[dict]] = {"fitrl": [], "trl": []}
                i = 0
                for seed in args.seeds:
                    for rep in range(args.repeats):
                        for side in (("fitrl", "trl") if i % 2 == 0 else ("trl", "fitrl")):
                            name = f"{side}-{label}-{precision}-t{threads}-s{seed}-r{rep}"
                            spec = {"side": side, "model": str(models[label][0]), "data": str(DATA),
                                    "steps": args.steps, "seed": seed, "threads": threads, "precision": precision,
                                    "micro_batch": args.micro_batch, "fitrl_set": args.fitrl_set, **TASKS[args.task],
                                    "run_dir": str(work / "runs" / name),
                                    "log": str(work / "runs" / f"{name}.log"),
                                    "result": str(work / "runs" / f"{name}.json")}
                            if side in args.sides:
                                r = run_child(spec, cold_cache(work, name, env) if side == "fitrl" and args.cold_plan
                                              else env)
                            elif name in reused:
                                r = reused[name]
                            else:
                                continue
                            record.append({"run": name, **{k: v for k, v in r.items() if k != "traceback"}})
                            if "error" not in r:
                                r = summarise(r, args.warmup)
                            runs[side].append(r)
                            status = r.get("error") or f"{r['s_per_step']:.3f} s/step, wall {r['wall_s']:.1f} s"
                            print(f"  {name}: {status}{'' if side in args.sides else ' (reused)'}", flush=True)
                        i += 1
                print_cell(f"{label} ({models[label][1]['params'] / 1e6:.2f}M params), {precision}, {threads} thread(s)",
                           runs, peaks[threads], precision)
    if args.json:
        Path(args.json).write_text(json.dumps({"peaks": peaks, "runs": record}, indent=1))


if __name__ == "__main__":
    main()
