"""``make gpu-check``: what a lent GPU should measure, prepared so one short call does it all.

0. ``fitrl doctor --device cuda`` (docs/doctor.md; world size 1 on one GPU): its report is
   ``doctor.json``, its lines ``doctor.log``;
1. two probes, each in a fresh process: the memory a bare CUDA context takes (the device's use
   before and after ``torch.cuda`` initialises, the allocator's own blocks subtracted, then after
   the first cuBLAS matmul), and the pinned host cache (pinned tensors of odd sizes: the process's
   RSS growth and the host allocator's reserve against the tensors' bytes, the rounding per
   tensor, and what stays cached after they are freed);
2. the ``gpu`` test tier (``tests/test_gpu.py``, ``tests/test_vllm_gpu.py``: the latter skips without vLLM);
3. for each case below, the memory plan of the run (``fitrl.planner.plan_config``, the trainer
   rank on this device) against what the run measured per phase at its second step (the first
   has no AdamW states before its update): peak allocated, peak reserved (the caching
   allocator's high-water mark: allocated plus fragmentation), the device's use at the phase's
   end as the driver reports it (reserved plus the CUDA context and cuBLAS workspaces) and the
   process's host peak; plus the step's rollout and update throughput and MFU (``perf/*``).

Each case is a real model shape (Qwen2.5-0.5B/1.5B/3B, Qwen2.5-VL-3B config.json) with random
weights, built on the device, and a shipped toy task (``examples/arith.yaml``; the VL case
``examples/shapes_vl.yaml``, its pictures resized to 448 x 448) with ``rollout.ignore_eos``, so
every response is exactly the length cap and the plan at the caps is the run's shape; bf16
autocast over fp32 master weights (``actor.fsdp.mixed_precision``, one process). Each runs in a
process of its own (a clean CUDA context and allocator), two steps, nothing saved.

Two cases are variants of ``q05`` for what a single case cannot show: ``q05-fp32`` (no mixed
precision: bf16 against fp32 step cost) and ``q05-expandable`` (``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``: the allocator's reserve factor, peak reserved over peak allocated per
phase, with expandable segments on and off).

On a machine without CUDA (CI), or with ``--dry``, only the planning half runs (the same table
with the measured columns empty), the doctor runs its quick CPU rungs (``devices``,
``attention``) and the probes run their CPU plumbing (no context to measure; unpinned tensors).
Results: ``gpu_check.json`` and ``gpu_check.md`` in ``--out``
(default ``$OUT`` where set, else ``runs/gpu-check``); each case's JSON is written as soon as it
ends, so a call cut short still returns what finished. Six files in all (a lent machine returns
eight at most): those two, ``doctor.json`` and ``doctor.log``, ``gpu_tests.log``, ``cases.log``.
``--budget-s`` counts from the start, the doctor's minutes included.

    make gpu-check                                # on a GPU: the doctor, the probes, the tier, every case
    python3 bench/gpu_check.py --dry              # plans, the doctor's CPU rungs, the probes' plumbing (CI)
    python3 bench/gpu_check.py --only q05 --skip-tests --budget-s 120
    python3 bench/gpu_check.py --replan bench/gpu_calibration/h100-2026-11-27.json   # recorded vs today's plan
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_probes import (PINNED_REPEAT, PINNED_SIZES, PROBES, context_figures,  # noqa: F401 (tests read them here)
                        pinned_figures)
from gpu_tables import comparisons, extra_tables  # noqa: F401 (tests read them here)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GIB = 1024**3
PHASES = ("rollout", "old_logprob", "ref_logprob", "update")
MEASURED = {"ref_logprob": "ref"}  # the plan's phase -> the run's, where they differ (fitrl/report/load.py)
# Qwen2.5-0.5B's config.json (https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json); the
# 1.5B and 3B shapes are the field corpus's (bench/field_corpus/models.yaml)
QWEN_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=32768, torch_dtype="bfloat16")
CORPUS_MODELS = {"qwen2.5-1.5b": "qwen2.5-math-1.5b", "qwen2.5-3b": "qwen2.5-3b-instruct",
                 "qwen2.5-vl-3b": "qwen2.5-vl-3b-instruct"}
# what Qwen2.5-VL-3B's config.json has beyond the corpus's keys: its tower's heads and windows, its
# text rope's multimodal sections (head_dim 128: 16 + 24 + 24 frequencies)
VL_EXTRA = {"vision": dict(num_heads=16, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
            "mrope_section": [16, 24, 24]}


@dataclass(frozen=True)
class Case:
    name: str
    model: str            # qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-3b
    prompts: int          # data.rollout_batch_size
    n: int                # rollout.n
    response: int         # rollout.max_response_length (every response: ignore_eos)
    micro: int            # actor.micro_batch_size
    logprob_micro: int    # actor.logprob_micro_batch_size
    ckpt: bool            # actor.model.gradient_checkpointing
    chunk: int = 1024     # actor.logprob_chunk_size
    extra: tuple[str, ...] = ()
    task: str = "arith"   # arith (examples/arith.yaml) | shapes (examples/shapes_vl.yaml: pictures)
    env: tuple[tuple[str, str], ...] = ()  # the case process's environment beyond this one's

    def overrides(self) -> list[str]:
        return [f"data.rollout_batch_size={self.prompts}", f"actor.mini_batch_size={self.prompts}",
                f"rollout.n={self.n}", f"rollout.max_response_length={self.response}", "rollout.ignore_eos=true",
                f"actor.micro_batch_size={self.micro}", f"actor.logprob_micro_batch_size={self.logprob_micro}",
                f"actor.model.gradient_checkpointing={str(self.ckpt).lower()}",
                f"actor.logprob_chunk_size={self.chunk}", "actor.fsdp.mixed_precision=true", *self.extra]

    @property
    def label(self) -> str:
        lora = next((e.split("=")[1] for e in self.extra if e.startswith("actor.lora.rank=")), None)
        kl = " + KL" if "algorithm.use_kl_loss=true" in self.extra else ""
        fp32 = " | fp32" if "actor.fsdp.mixed_precision=false" in self.extra else ""
        env = "".join(f" | {k}={v}" for k, v in self.env)
        return (f"{self.model} | {self.prompts * self.n} seq R{self.response} | micro {self.micro} | "
                f"ckpt {'on' if self.ckpt else 'off'} | chunk {self.chunk}" + (f" | LoRA r{lora}{kl}" if lora else "")
                + (" | images" if self.task == "shapes" else "") + fp32 + env)


# In priority order: a call that runs out of time keeps the first ones. About a minute each on an H100.
# q3-vl has not run on a GPU yet (added after the first calibration).
EXPANDABLE = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
CASES = [
    Case("q05", "qwen2.5-0.5b", 4, 8, 512, 8, 16, ckpt=False),
    # q05 again: fp32 compute (bf16 against fp32 step cost), and under expandable segments (reserve factors)
    Case("q05-fp32", "qwen2.5-0.5b", 4, 8, 512, 8, 16, ckpt=False, extra=("actor.fsdp.mixed_precision=false",)),
    Case("q05-expandable", "qwen2.5-0.5b", 4, 8, 512, 8, 16, ckpt=False, env=EXPANDABLE),
    Case("q05-ckpt", "qwen2.5-0.5b", 4, 8, 512, 16, 16, ckpt=True),
    Case("q15-long", "qwen2.5-1.5b", 2, 8, 1024, 4, 8, ckpt=True, chunk=512),
    Case("q15-lora-kl", "qwen2.5-1.5b", 4, 8, 512, 8, 16, ckpt=False,
         extra=("actor.lora.rank=16", "actor.lora.alpha=32", "algorithm.use_kl_loss=true")),
    Case("q3-ckpt", "qwen2.5-3b", 2, 8, 512, 4, 8, ckpt=True),
    # the shapes task's pictures resized to 448 x 448 (1,024 patches, 256 image tokens each): the tower's memory
    # (LoRA: full fine-tuning's fp32 weights, gradients and AdamW states alone take 63 of the 79 GiB)
    Case("q3-vl", "qwen2.5-vl-3b", 2, 8, 256, 4, 8, ckpt=True, task="shapes",
         extra=("data.min_pixels=200704", "data.max_pixels=200704", "data.max_prompt_length=768",
                "actor.lora.rank=16", "actor.lora.alpha=32")),
]


def model_config(model: str) -> dict:
    if model == "qwen2.5-0.5b":
        return dict(QWEN_05B)
    import yaml

    entries = yaml.safe_load((ROOT / "bench" / "field_corpus" / "models.yaml").read_text())
    return dict(entries[CORPUS_MODELS[model]]["config"])


def run_config(case: Case, model_dir: Path, run_dir: Path, device: str):
    from fitrl.config import load_config

    data = ROOT / "examples" / "data"
    example, train = {"arith": ("arith.yaml", "arith_train.jsonl"), "shapes": ("shapes_vl.yaml", "shapes_train.jsonl")}[
        case.task]
    return load_config(str(ROOT / "examples" / example), [
        f"actor.model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.device={device}",
        f"data.train_files=[{data / train}]", 'data.val_files=[]',
        "trainer.max_steps=2", "trainer.val_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
        "trainer.num_threads=0", "checkpoint.save_final=false", "memory.plan=off", "memory.phase_peaks=rewind",
        *case.overrides()])


def plan_case(case: Case, gpu_memory: int) -> dict:
    """The plan of ``case`` for one device of ``gpu_memory`` bytes: per phase the trainer rank's
    device total and its components, and its host figure (caps and, where shorter, expected lengths)."""
    from fitrl.memory.model import Hardware, machine_ram
    from fitrl.planner.plan import plan_config

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(model_config(case.model)))
        cfg = run_config(case, Path(tmp), Path(tmp) / "run", "cuda")
        plan = plan_config(cfg, Hardware.for_config(cfg, gpus_per_node=1, gpu_memory=gpu_memory,
                                                    host_memory=machine_ram()))
    out = {}
    for at, p in (("caps", plan), ("expected", plan.expected)):
        if p is None:
            continue
        trainer = p.process("trainer")
        out[at] = {ph: {"gpu": sum(u.gpu.values()) / GIB, "host": sum(u.host.values()) / GIB,
                        "gpu_parts": {k: v / GIB for k, v in sorted(u.gpu.items(), key=lambda kv: -kv[1])}}
                   for ph, u in trainer.phases.items() if ph in PHASES}
    out["verdict"] = plan.verdict
    return out


# ----------------------------------------------------------------------------- the measured half
def build_model(model: str, out_dir: Path) -> Path:
    """A model directory of ``model``'s shape with random bf16 weights (initialised on the device),
    the tiny qwen2 tokenizer and generation config (token ids below any real vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from fitrl.models.tiny import make_tiny_model

    shape = {k: v for k, v in model_config(model).items() if k != "torch_dtype"}
    vl = "vision_config" in shape
    make_tiny_model(out_dir, arch="qwen2_5_vl" if vl else "qwen2", size="tiny", seed=0)
    cfg_path = out_dir / "config.json"
    config = json.loads(cfg_path.read_text())
    if vl:  # the tiny VL directory's processor files and token ids, the real shape's text and tower
        vision = {**shape.pop("vision_config"), **VL_EXTRA["vision"]}
        vision["in_channels"] = vision.pop("in_chans", 3)
        config["vision_config"].update(vision)
        text = config["text_config"]
        text.update({k: v for k, v in shape.items() if k != "model_type"})
        text["rope_parameters"]["mrope_section"] = VL_EXTRA["mrope_section"]
        config["tie_word_embeddings"] = shape["tie_word_embeddings"]
    else:
        text = config
        config.update(shape)
    for key in ("layer_types", "max_window_layers"):  # per-layer lists of the tiny shape: derived again
        text.pop(key, None)
    config["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(config))
    (out_dir / "model.safetensors").unlink()
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (CPU: the script's own smoke test)
        m = auto.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.bfloat16)
    m.save_pretrained(out_dir)
    del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out_dir


def measure_case(case: Case, work: Path) -> dict:
    """Run ``case`` two steps on the GPU in this process; its step-2 figures per phase."""
    import torch

    from fitrl.trainer.run import train

    t0 = time.perf_counter()
    model_dir = build_model(case.model, work / "model")
    built = time.perf_counter() - t0
    cuda = torch.cuda.is_available()
    context, total = 0, 0
    if cuda:  # what a process holds outside the allocator: context, cuBLAS workspace (after one matmul)
        torch.cuda.init()
        (torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")).sum().item()
        free, total = torch.cuda.mem_get_info()
        context = total - free - torch.cuda.memory_reserved()
    history = train(run_config(case, model_dir, work / "run", "cuda" if cuda else "cpu"))
    lines = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [m for m in lines if m.get("step") == 2 and "reward/mean" in m][-1]
    phases = {}
    for ph in PHASES:
        key = f"mem/rank0/{MEASURED.get(ph, ph)}"
        if f"{key}/host_peak_gib" not in step:
            continue
        phases[ph] = {f: step.get(f"{key}/{f}_gib") for f in (
            "gpu_peak", "gpu_peak_reserved", "gpu_allocated", "gpu_reserved", "gpu_device_used", "host_peak")}
    perf = {k: v for k, v in step.items() if k.startswith("perf/") or k.startswith("time/")}
    return {"phases": phases, "perf": perf, "context_gib": context / GIB, "device_total_gib": total / GIB,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "build_s": built,
            "run_s": time.perf_counter() - t0 - built, "steps": len(history)}


# ----------------------------------------------------------------------------- the table
def table(results: list[dict]) -> str:
    head = ("| case | phase | plan GiB (expected / caps) | measured: device peak* | peak reserved | peak allocated "
            "| error of plan vs device peak | host plan / measured GiB |\n|---|---|---|---|---|---|---|---|")
    rows = [head]
    for r in results:
        plan, meas = r["plan"], r.get("measured") or {}
        at = "expected" if "expected" in plan else "caps"
        for ph, p in plan[at].items():
            caps = plan["caps"][ph]["gpu"]
            m = (meas.get("phases") or {}).get(ph)
            if m and m.get("gpu_device_used") is not None:
                # device peak: the allocator's high-water mark plus what the driver shows beyond it at the end
                outside = m["gpu_device_used"] - m["gpu_reserved"]
                dev = m["gpu_peak_reserved"] + outside
                err = f"{100 * (p['gpu'] - dev) / dev:+.1f} %"
                cols = (f"{dev:.2f}", f"{m['gpu_peak_reserved']:.2f}", f"{m['gpu_peak']:.2f}", err,
                        f"{p['host']:.2f} / {m['host_peak']:.2f}")
            else:
                cols = ("—", "—", "—", "—", f"{p['host']:.2f} / " + (f"{m['host_peak']:.2f}" if m else "—"))
            rows.append(f"| {r['case']} | {ph} | {p['gpu']:.2f} / {caps:.2f} | " + " | ".join(cols) + " |")
    rows.append("\n*device peak = peak reserved + (device used − reserved) at the phase's end: the CUDA context, "
                "cuBLAS workspaces and anything else outside PyTorch's allocator.")
    perf_rows = []
    for r in results:
        p = (r.get("measured") or {}).get("perf") or {}
        if p:
            perf_rows.append(f"| {r['case']} | {p.get('perf/rollout_tokens_per_s', 0):,.0f} | "
                             f"{p.get('perf/update_tokens_per_s', 0):,.0f} | {100 * p.get('perf/mfu', 0):.1f} % | "
                             f"{100 * p.get('perf/update_mfu', 0):.1f} % | {r['measured']['context_gib']:.2f} |")
    if perf_rows:
        rows += ["", "| case | rollout tokens/s | update tokens/s | step MFU | update MFU | context GiB |",
                 "|---|---|---|---|---|---|", *perf_rows]
    return "\n".join(rows)


def replan(cases: list[dict]) -> list[dict]:
    """Recorded results with each case planned again by today's planner (for the device they ran on)."""
    by_name = {c.name: c for c in CASES}
    return [{**r, "plan": plan_case(by_name[r["case"]], int(r["measured"]["device_total_gib"] * GIB))}
            for r in cases if "phases" in r.get("measured", {})]


def run_tests(out: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "tests/test_gpu.py", "tests/test_vllm_gpu.py"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{_text(e.stdout)}{_text(e.stderr)}\ntimed out after {timeout} s", 124
    (out / "gpu_tests.log").write_text(text)
    summary = [line for line in text.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return {"rc": rc, "summary": summary[-1] if summary else text[-300:], "seconds": time.perf_counter() - t0}


def run_case(case: Case, out: Path, timeout: int) -> dict:
    """Measure ``case`` in a process of its own; its output is appended to ``cases.log`` (a lent
    machine returns a few files only: one log for every case)."""
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, __file__, "--run-case", case.name, "--work", work, "--out", str(out)]
        env = {**os.environ, **dict(case.env)}
        if "PYTORCH_CUDA_ALLOC_CONF" not in dict(case.env):  # the other cases: the allocator's defaults
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"{_text(e.stdout)}{_text(e.stderr)}\ntimed out after {timeout} s", 124
        with (out / "cases.log").open("a") as f:
            f.write(f"===== {case.name}: {case.label} (exit {rc})\n{log}\n")
        got = Path(work) / "measured.json"
        return json.loads(got.read_text()) if rc == 0 and got.exists() else {"error": f"exit {rc}: {log[-800:]}"}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


# ----------------------------------------------------------------------------- the doctor and the probes
def doctor_step(out: Path, dry: bool, timeout: int) -> dict:
    """``fitrl doctor`` first (docs/doctor.md): on the GPU every rung one GPU runs (world size 1);
    dry, the quick CPU rungs only (the plumbing CI checks)."""
    report = out / "doctor.json"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "fitrl.cli", "doctor", "--device", "cpu" if dry else "cuda", "--json", str(report),
           *(["--only", "devices", "attention"] if dry else [])]
    # the checkout first on the path: a lent machine has no fitrl installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{_text(e.stdout)}{_text(e.stderr)}\ntimed out after {timeout} s", 124
    (out / "doctor.log").write_text(text)
    rungs = json.loads(report.read_text())["rungs"] if report.exists() else []
    return {"rc": rc, "seconds": time.perf_counter() - t0, "rungs": {r["rung"]: r["status"] for r in rungs},
            "lines": [x for x in text.splitlines() if x[:5] in ("PASS ", "FAIL ", "SKIP ")]}


def run_probe(name: str, out: Path, timeout: int) -> dict:
    """One probe in a process of its own (a context or a host cache from before would hide its figure)."""
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, __file__, "--probe", name, "--work", work, "--out", str(out)]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            log, rc = f"{_text(e.stdout)}{_text(e.stderr)}\ntimed out after {timeout} s", 124
        got = Path(work) / "probe.json"
        return json.loads(got.read_text()) if rc == 0 and got.exists() else {"error": f"exit {rc}: {log[-800:]}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="plans only (also where no CUDA device is found)")
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu-check"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-doctor", action="store_true", help="leave out `fitrl doctor` (step 0)")
    ap.add_argument("--skip-probes", action="store_true", help="leave out the context and pinned-cache probes")
    ap.add_argument("--budget-s", type=float, default=360, help="no case starts after this many seconds")
    ap.add_argument("--case-timeout-s", type=int, default=150)
    ap.add_argument("--tests-timeout-s", type=int, default=150)
    ap.add_argument("--doctor-timeout-s", type=int, default=240)
    ap.add_argument("--replan", metavar="JSON", help="a recorded gpu_check.json: its measurements against "
                    "today's plan (no GPU needed), e.g. bench/gpu_calibration/h100-2026-11-27.json")
    ap.add_argument("--run-case", help=argparse.SUPPRESS)  # the child: measure one case, write its JSON
    ap.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)  # the child: one probe
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = {c.name for c in CASES}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        ap.error(f"--only {' '.join(unknown)}: no such case; the cases are {', '.join(c.name for c in CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.probe:
        (Path(args.work) / "probe.json").write_text(json.dumps(PROBES[args.probe]()))
        return 0
    if args.run_case:
        case = next(c for c in CASES if c.name == args.run_case)
        (Path(args.work) / "measured.json").write_text(json.dumps(measure_case(case, Path(args.work))))
        return 0

    if args.replan:
        print(table(replan(json.loads(Path(args.replan).read_text())["cases"])))
        return 0
    import torch

    dry = args.dry or not torch.cuda.is_available()
    if dry and not args.dry:
        print("no CUDA device: dry mode (the planning half only)")
    started = time.perf_counter()
    report: dict = {"dry": dry, "cases": []}
    (out / "cases.log").unlink(missing_ok=True)
    if not args.skip_doctor:  # first: what a user runs on a new node, here at world size 1
        report["doctor"] = doctor_step(out, dry, args.doctor_timeout_s)
        print(f"fitrl doctor: exit {report['doctor']['rc']}", *report["doctor"]["lines"], sep="\n", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    if not args.skip_probes:
        report["probes"] = {name: run_probe(name, out, timeout=120) for name in PROBES}
        print("probes:", json.dumps(report["probes"]), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    if not dry and not args.skip_tests:
        report["tests"] = run_tests(out, timeout=args.tests_timeout_s)
        print("gpu tier:", report["tests"]["summary"], flush=True)
    gpu_memory = torch.cuda.mem_get_info()[1] if not dry else 80 * GIB
    for case in [c for c in CASES if not args.only or c.name in args.only]:
        result = {"case": case.name, "label": case.label, "spec": asdict(case), "plan": plan_case(case, gpu_memory)}
        if not dry:
            if time.perf_counter() - started > args.budget_s:
                result["measured"] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            else:
                result["measured"] = run_case(case, out, args.case_timeout_s)
        report["cases"].append(result)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        print(f"{case.name}: {case.label}: {'planned' if dry else 'measured' if 'phases' in result.get('measured', {}) else result['measured']}",
              flush=True)
    report["comparisons"] = comparisons(report["cases"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    text = table(report["cases"]) + extra_tables(report)
    (out / "gpu_check.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
