"""Image pipeline host memory of a vision-language run: the plan against telemetry.

    .venv/bin/python bench/vl_image_memory.py                 # glibc's defaults, ~4 min on 2 cores
    .venv/bin/python bench/vl_image_memory.py --malloc mmap   # MALLOC_MMAP_THRESHOLD_=65536, ~4.5 min
    .venv/bin/python bench/vl_image_memory.py --vision-block  # what a vision block saves for backward

Builds a tiny Qwen2.5-VL (``fitrl make-tiny-model --arch qwen2_5_vl``; see :func:`make_model`)
and ``--rows`` (16) noisy ``--side`` x ``--side`` (2048) PNG pictures drawn here with PIL (both
cached under ``.cache/bench_vl/``; every picture is decoded in full at each draw), then trains
GRPO in-process on CPU (``trainer.backend=inprocess``, the default; 8 prompts x 2 samples,
micro-batches of 4, 2 response tokens, one thread) for ``--steps`` (3) steps, twice, in fresh
processes, everything identical but the pixel budget:

- *large*: ``data.max_pixels=4194304``: a 2048 x 2048 picture becomes 2044 x 2044 (73 x 73 LM
  tokens of 2 x 2 patches: 21,316 patches, 100 MB of fp32 ``pixel_values`` per prompt);
- *small*: ``data.max_pixels=12544``: the same picture becomes 112 x 112 (64 patches, 16 tokens).

So that the language model sees the same sequences in both runs, the small run's rows carry as
many extra text tokens (``" a"``, one token each) as its pictures have fewer image tokens: every
prompt is as long in both runs (checked: 5,352 tokens), ``data.max_prompt_length`` is the same,
and what the two runs differ by is the image pipeline alone (decoding, processing, the step's
pixel values, each micro-batch's concatenated copies, the vision tower's activations).

Measured (``RUN/metrics.jsonl``): ``mem/rank0/<phase>/host_peak_gib``, the RSS high-water mark
of the run's one process within the phase (``VmHWM`` after ``clear_refs``; in-process the driver
is rank 0 and holds the trainer and the rollout engine too), the largest over steps 2.. (the
plan's steady state: AdamW states exist and glibc holds what the previous update left).
Predicted: the plan of the same config for this machine (:func:`fitrl.trainer.preflight.detect_hardware`
and :func:`fitrl.planner.plan.plan_config`, as ``fitrl train``'s preflight makes it; the run's
``RUN/plan.json`` is checked to hold the same figures): node 0's host memory per phase (an
in-process run's processes are one). Phases: the plan's ``rollout`` is telemetry's ``data``
(the driver decodes and processes the step's pictures and holds their pixel values), ``rollout``
(generate) and ``reward``, their largest peak; ``old_logprob`` and ``update`` are the same in
both. Also the driver's part alone: the step's pixel values and one prompt being decoded and
processed (:meth:`fitrl.memory.run.Run.pixel_values_bytes` and ``image_processing_bytes``)
against telemetry's ``data`` phase of step 1 (no update has run: nothing retained yet).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
CHILD = """
import sys, time
from rich.console import Console
from fitrl.config import load_config
from fitrl.trainer.run import train
cfg = load_config(None, sys.argv[1:])
start = time.perf_counter()
train(cfg, Console(quiet=True))
print("WALL", time.perf_counter() - start)
"""
BUDGETS = {"large": 4194304, "small": 12544}
PHASES = {"rollout": ("data", "rollout", "reward"), "old_logprob": ("old_logprob",), "update": ("update",)}
"""Plan phase -> the telemetry phases it covers (their largest peak is compared)."""


def make_model(model: Path) -> None:
    """The tiny Qwen2.5-VL of ``fitrl make-tiny-model --arch qwen2_5_vl``, with window attention
    in every vision block: the tiny tower's one full-attention block makes 21,316 patches attend
    to each other, ~60 GFLOP per picture per forward on CPU, half an hour for the bench. Memory
    is the same either way (SDPA does not materialise the attention matrix; the blocks' tensors
    are the same), and the planner does not read this key."""
    from fitrl.models.tiny import make_tiny_model

    make_tiny_model(model, arch="qwen2_5_vl", size="tiny", seed=0)
    config = json.loads((model / "config.json").read_text())
    config["vision_config"]["fullatt_block_indexes"] = []
    (model / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_images(folder: Path, rows: int, side: int) -> list[str]:
    """``rows`` noisy RGB pictures (smooth colour fields plus pixel noise, so that PNG decoding
    does real work: ~2.4 B per pixel on disk), written once."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(rows):
        name = f"noise_{side}_{i:03d}.png"
        names.append(name)
        if (folder / name).is_file():
            continue
        g = np.random.default_rng(i)
        coarse = Image.fromarray(g.integers(0, 256, (side // 64, side // 64, 3), dtype=np.uint8)).resize(
            (side, side), Image.BILINEAR)
        pixels = np.asarray(coarse, dtype=np.int16) + g.integers(-24, 25, (side, side, 3), dtype=np.int16)
        tmp = folder / (name + ".tmp")
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(tmp, format="PNG", compress_level=1)
        tmp.replace(folder / name)
    return names


def write_data(folder: Path, names: list[str], filler: int, tag: str) -> Path:
    """One row per picture, ``<image>``, ``filler`` extra text tokens, a sum to answer."""
    path = folder / f"train_{tag}.jsonl"
    with path.open("w") as f:
        for i, name in enumerate(names):
            a, b = i % 7 + 1, i % 5 + 2
            text = "<image>" + " a" * filler + f" What is {a} + {b}?"
            f.write(json.dumps({"prompt": text, "answer": str(a + b), "images": [name]}) + "\n")
    return path


def overrides(args, model: Path, data: Path, max_pixels: int, run_dir: str) -> list[str]:
    return [f"actor.model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]",
            f"data.max_pixels={max_pixels}", "data.min_pixels=3136", "data.limit_images=1",
            f"data.max_prompt_length={args.prompt_len}", f"data.rollout_batch_size={args.prompts}",
            f"rollout.n={args.n}", f"rollout.max_response_length={args.response_len}", "rollout.top_k=50",
            f"rollout.micro_batch_size={args.micro}", f"actor.mini_batch_size={args.prompts}",
            f"actor.micro_batch_size={args.micro}", f"actor.logprob_micro_batch_size={args.micro}",
            "algorithm.fold_old_logprob=false",  # the old-log-prob pass is one of the measured phases
            "reward.function=arith", "reward.num_workers=0", "trainer.device=cpu",
            # one thread: on this shared 2-core machine two OpenMP threads wait on each other at
            # every one of the vision tower's ~700 small attention calls per picture (6.5 s vs 0.2 s)
            f"trainer.num_threads={args.threads}", f"trainer.max_steps={args.steps}", f"trainer.run_dir={run_dir}",
            "trainer.progress_bar=false", "trainer.val_before_train=false", "checkpoint.save_final=false",
            "memory.plan=warn", "memory.phase_peaks=rewind", f"plan.host_malloc={args.malloc}"]


def prompt_lengths(args, model: Path, data: Path, max_pixels: int) -> list[int]:
    """Token lengths of the rows' prompts as the trainer builds them (image tokens included)."""
    from transformers import AutoTokenizer

    from fitrl.config import load_config
    from fitrl.trainer.run import build_datasets

    cfg = load_config(None, overrides(args, model, data, max_pixels, "unused"))
    train, _ = build_datasets(cfg, AutoTokenizer.from_pretrained(str(model)))
    if train.num_filtered:
        raise SystemExit(f"{train.num_filtered} rows longer than data.max_prompt_length={args.prompt_len}")
    return [len(train[i]["prompt_ids"]) for i in range(len(train))]


def predict(args, model: Path, data: Path, max_pixels: int) -> dict:
    """The plan per phase: node 0's host (the in-process run's one process) and the driver's image buffers."""
    from fitrl.config import load_config
    from fitrl.memory.run import Run
    from fitrl.planner.plan import plan_config
    from fitrl.trainer.preflight import detect_hardware

    cfg = load_config(None, overrides(args, model, data, max_pixels, "unused"))
    plan = plan_config(cfg, detect_hardware(cfg))
    run = Run(cfg, plan.hardware, plan.shape, None, plan.spec)
    out = {ph: {"node": sum(plan.node_host(ph).values()), "components": plan.node_host(ph)} for ph in plan.phases}
    # what telemetry's data phase holds at its peak: the step's pixel values and one prompt being
    # decoded and processed (in the plan's rollout phase generation's transient hides the latter)
    out["data"] = {"driver": run.pixel_values_bytes(cfg.data.rollout_batch_size) + run.image_processing_bytes()}
    return out


def child_env(malloc: str) -> dict:
    """glibc's defaults, as users run, or ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor of 64 KiB
    or more mapped and unmapped: RSS follows the live tensors, nothing is retained)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop(MMAP_ENV, None)
    if malloc == "mmap":
        env[MMAP_ENV] = "65536"
    return env


def measure(args, model: Path, data: Path, max_pixels: int, run_dir: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, *overrides(args, model, data, max_pixels, run_dir)],
                         cwd=ROOT, capture_output=True, text=True, env=child_env(args.malloc))
    if out.returncode:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"training run failed (data.max_pixels={max_pixels})")
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r for r in records if "reward/mean" in r],
            "plan_json": json.loads((Path(run_dir) / "plan.json").read_text()), "wall": time.perf_counter() - t0}


def peak(steps: list[dict], phases: tuple[str, ...]) -> int:
    """The largest ``mem/rank0/<phase>/host_peak_gib`` over ``phases`` and ``steps``, in bytes."""
    return int(max(s[f"mem/rank0/{ph}/host_peak_gib"] for s in steps for ph in phases) * GIB)


def rows(result: dict) -> list[dict]:
    """Per compared phase: predicted and measured peaks of both runs and their differences."""
    out = []
    for ph, tele in PHASES.items():
        pred = {k: result[k]["plan"][ph]["node"] for k in BUDGETS}
        # steady state: from step 2 on (a one-step run: its step)
        meas = {k: peak(result[k]["steps"][1:] or result[k]["steps"], tele) for k in BUDGETS}
        out.append({"what": f"{ph} ({', '.join(tele)})", "pred": pred, "meas": meas})
    # the driver's part alone, in the one phase where nothing else runs: step 1's data phase (no
    # update has run yet, so nothing is retained; both runs start it from the same state, so the
    # difference of the peaks is the difference of what the phase added)
    pred = {k: result[k]["plan"]["data"]["driver"] for k in BUDGETS}
    meas = {k: peak(result[k]["steps"][:1], ("data",)) for k in BUDGETS}
    out.append({"what": "driver: prompts' images (data, step 1)", "pred": pred, "meas": meas, "diff_only": True})
    for r in out:
        r["pred_diff"] = r["pred"]["large"] - r["pred"]["small"]
        r["meas_diff"] = r["meas"]["large"] - r["meas"]["small"]
        r["error"] = r["pred_diff"] / r["meas_diff"] - 1
    return out


def print_table(table: list[dict], result: dict) -> None:
    g = lambda n: f"{n / GIB:.3f}"  # noqa: E731
    print("| phase (plan <- telemetry) | large: predicted | measured | error | small: predicted | measured | error "
          "| image pipeline (large - small): predicted | measured | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        p, m = r["pred"], r["meas"]
        cells = [r["what"]]
        for k in BUDGETS:  # the driver's row predicts its images alone, not the process: no absolute error
            cells += ["–", g(m[k]), "–"] if r.get("diff_only") else [g(p[k]), g(m[k]), f"{p[k] / m[k] - 1:+.1%}"]
        cells += [g(r["pred_diff"]), g(r["meas_diff"]), f"{r['error']:+.1%}"]
        print("| " + " | ".join(cells) + " |")
    for k in BUDGETS:
        print(f"{k}: wall {result[k]['wall']:.0f} s, plan components (GiB):")
        for ph in PHASES:
            comps = result[k]["plan"][ph]["components"]
            print(f"  {ph}: " + ", ".join(f"{c} {v / GIB:.3f}" for c, v in comps.items()))
        for s in result[k]["steps"]:
            print(f"  step {s['step']} peak / end RSS (GiB): " + ", ".join(
                f"{ph} {s[f'mem/rank0/{ph}/host_peak_gib']:.3f} / {s[f'mem/rank0/{ph}/host_rss_gib']:.3f}"
                for ph in ("data", "rollout", "reward", "old_logprob", "advantage", "update")))


def prepare(args, cache: Path) -> tuple[Path, dict[str, Path], list[int], int]:
    """The model, the pictures and the two runs' data files under ``cache``; the prompts' token
    lengths (the same in both runs) and the small run's filler tokens."""
    from fitrl.data.images import smart_resize
    from fitrl.models.shape import ModelShape

    model = cache / "tiny-qwen2_5_vl"
    if not (model / "config.json").is_file():
        make_model(model)
    images = cache / "images"
    names = make_images(images, args.rows, args.side)
    # the small run's prompts get the image tokens its pictures lack as text tokens
    factor = ModelShape.from_path(str(model)).vision.factor
    (h1, w1), (h2, w2) = (smart_resize(args.side, args.side, factor=factor, min_pixels=3136, max_pixels=v)
                          for v in BUDGETS.values())
    filler = (h1 * w1 - h2 * w2) // factor**2
    data = {"large": write_data(images, names, 0, "large"), "small": write_data(images, names, filler, "small")}
    lengths = {k: prompt_lengths(args, model, data[k], v) for k, v in BUDGETS.items()}
    if lengths["large"] != lengths["small"]:
        raise SystemExit(f"prompt lengths differ: {lengths}")
    return model, data, lengths["large"], filler


def compare(args, cache: Path) -> dict:
    """Both runs, their plans, and the table (:func:`rows`)."""
    model, data, lengths, filler = prepare(args, cache)
    print(f"{args.rows} pictures {args.side} x {args.side}; prompts of {min(lengths)}-{max(lengths)} tokens in both "
          f"runs (small: {filler} filler tokens); allocator {args.malloc}", flush=True)
    result: dict = {"args": vars(args), "prompt_lengths": lengths, "filler": filler}
    with tempfile.TemporaryDirectory() as tmp:
        for k, mp in BUDGETS.items():
            result[k] = {"plan": predict(args, model, data[k], mp), **measure(args, model, data[k], mp, f"{tmp}/{k}")}
            ours = {ph: round(result[k]["plan"][ph]["node"] / GIB, 6) for ph in PHASES}
            theirs = {ph: round(result[k]["plan_json"]["node_peaks_gib"][ph]["host"], 6) for ph in PHASES}
            if ours != theirs:
                raise SystemExit(f"{k}: the run's plan.json {theirs} differs from the plan made here {ours}")
            print(f"{k} (data.max_pixels={mp}): {result[k]['wall']:.0f} s", flush=True)
    result["table"] = rows(result)
    return result


def vision_block_saved() -> None:
    """``--vision-block``: the tensors one Qwen2.5-VL vision block saves for backward, per patch
    (distinct storages seen by ``saved_tensors_hooks``; 3 blocks minus 1, halved; window attention,
    SDPA, 1,024 patches), against the planner's ``14e + 4I`` (fitrl/memory/trainer.py)."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    def saved(e: int, inner: int, heads: int, depth: int, dtype) -> int:
        cfg = Qwen2_5_VLVisionConfig(depth=depth, hidden_size=e, intermediate_size=inner, num_heads=heads,
                                     out_hidden_size=64, window_size=112, fullatt_block_indexes=[])
        cfg._attn_implementation = "sdpa"
        model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=dtype).train()
        pixels = torch.randn(1024, 3 * 2 * 14 * 14)
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(pixels, grid_thw=torch.tensor([[1, 32, 32]]))
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {pixels.untyped_storage().data_ptr()}
        return sum(n for ptr, n in seen.items() if ptr not in skip)

    torch.set_num_threads(1)
    for e, inner, heads in ((32, 128, 2), (128, 512, 4), (1280, 3420, 16)):
        for dtype in (torch.float32, torch.bfloat16):
            size = torch.tensor([], dtype=dtype).element_size()
            per = (saved(e, inner, heads, 3, dtype) - saved(e, inner, heads, 1, dtype)) / 2 / 1024 / size
            print(f"e={e} I={inner} {str(dtype)[6:]}: {per:,.0f} elements saved per patch per block; "
                  f"14e + 4I = {14 * e + 4 * inner:,} ({(14 * e + 4 * inner) / per - 1:+.1%})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="pictures (rows) in the dataset")
    ap.add_argument("--side", type=int, default=2048, help="picture side in pixels")
    ap.add_argument("--prompts", type=int, default=8, help="data.rollout_batch_size")
    ap.add_argument("--n", type=int, default=2, help="rollout.n")
    ap.add_argument("--micro", type=int, default=4, help="rollout, log-prob and update micro-batch (sequences)")
    ap.add_argument("--steps", type=int, default=3, help="trainer.max_steps (steps 2.. are compared)")
    ap.add_argument("--response-len", type=int, default=2, help="rollout.max_response_length")
    ap.add_argument("--prompt-len", type=int, default=5400, help="data.max_prompt_length")
    ap.add_argument("--threads", type=int, default=1, help="trainer.num_threads")
    ap.add_argument("--malloc", choices=["glibc", "mmap"], default="glibc",
                    help="the runs' allocator: glibc's defaults, or MALLOC_MMAP_THRESHOLD_=65536 "
                         "(plan.host_malloc=mmap)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--vision-block", action="store_true",
                    help="only measure what a vision block saves for backward (the planner's 14e + 4I)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    if args.vision_block:
        return vision_block_saved()
    t0 = time.perf_counter()
    result = compare(args, ROOT / ".cache" / "bench_vl")
    print_table(result["table"], result)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
