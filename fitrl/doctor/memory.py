"""Rung ``memory``: the memory plan of a small run against what the run measured, per phase.

Two GRPO steps of the tiny policy on a toy arithmetic task in this process (a trainer rank in
one process, as ``make gpu-check`` measures its cases), with every response at the length cap
(``rollout.ignore_eos``) so the plan at the caps is the run's shape; the second step is read
(the first has no AdamW states before its update). On CUDA the device's peak (the allocator's
high-water mark plus what the driver shows beyond it: the context, cuBLAS workspaces) against
the plan's device total; on CPU the process's host peak against its host total. A phase over
its plan by more than the plan's band fails (an under-prediction is what runs out of memory);
one under it passes, the margin named.
"""

from __future__ import annotations

import json

from fitrl.doctor.child import RankContext
from fitrl.doctor.ladder import Failure, Passed

GIB = 1024**3
MEASURED = {"ref_logprob": "ref"}  # the plan's phase -> the run's name for it, where they differ


def small_run(ctx: RankContext):
    from fitrl.config import load_config

    data = ctx.work / "memory" / "arith.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b}) + "\n"
                            for a in range(4) for b in range(4)))
    return load_config(None, [
        f"actor.model.path={ctx.model_dir}", f"trainer.device={ctx.device_type}", f"data.train_files=[{data}]",
        "data.val_files=[]", "data.max_prompt_length=64", "data.rollout_batch_size=4", "actor.mini_batch_size=4",
        "actor.micro_batch_size=8", "actor.logprob_micro_batch_size=8", "rollout.n=4",
        "rollout.max_response_length=16", "rollout.ignore_eos=true", "reward.function=arith",
        f"trainer.run_dir={ctx.work / 'memory' / 'run'}", "trainer.max_steps=2", "trainer.val_freq=0",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.num_threads=0",
        "checkpoint.save_final=false", "memory.plan=off", "memory.phase_peaks=rewind"])


def planned(cfg, device_type: str) -> tuple[dict[str, float], float]:
    """Per phase the trainer rank's planned bytes (device on CUDA, host on CPU), and the band."""
    import torch

    from fitrl.memory.model import Hardware, machine_ram
    from fitrl.planner.plan import plan_config

    cuda = device_type == "cuda"
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    plan = plan_config(cfg, Hardware.for_config(cfg, gpus_per_node=1, gpu_memory=gpu_memory,
                                                host_memory=machine_ram(), device=device_type))
    phases = {ph: sum((u.gpu if cuda else u.host).values()) for ph, u in plan.process("trainer").phases.items()}
    return phases, plan.band("gpu")[0] if cuda else plan.host_band("trainer")


def measured(run_dir, device_type: str) -> dict[str, float]:
    """Per phase of the run's second step: the device peak (CUDA) or the host peak (CPU), bytes."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = [m for m in lines if m.get("step") == 2 and "reward/mean" in m][-1]
    out = {}
    for key in {k.split("/")[2] for k in step if k.startswith("mem/rank0/")}:
        m = {f: step.get(f"mem/rank0/{key}/{f}_gib") for f in
             ("host_peak", "gpu_peak_reserved", "gpu_reserved", "gpu_device_used")}
        if device_type == "cuda":
            if None not in (m["gpu_peak_reserved"], m["gpu_reserved"], m["gpu_device_used"]):
                out[key] = (m["gpu_peak_reserved"] + m["gpu_device_used"] - m["gpu_reserved"]) * GIB
        elif m["host_peak"] is not None:
            out[key] = m["host_peak"] * GIB
    return out


def memory(ctx: RankContext) -> Passed:
    from fitrl.trainer.run import train

    cfg = small_run(ctx)
    plan, band = planned(cfg, ctx.device_type)
    train(cfg)
    got = measured(ctx.work / "memory" / "run", ctx.device_type)
    rows = {ph: {"plan_gib": p / GIB, "measured_gib": got[MEASURED.get(ph, ph)] / GIB,
                 "error": (p - got[MEASURED.get(ph, ph)]) / got[MEASURED.get(ph, ph)]}
            for ph, p in plan.items() if MEASURED.get(ph, ph) in got and p > 0}
    if not rows:
        raise Failure(f"the run measured no phase the plan has (plan: {sorted(plan)}, measured: {sorted(got)})",
                      "a doctor bug, or the run's telemetry is off: report it")
    what = "device" if ctx.device_type == "cuda" else "host"
    data = {"resource": what, "band": band, "phases": rows}
    over = {ph: r for ph, r in rows.items() if r["error"] < -band}
    if over:
        ph, r = min(over.items(), key=lambda kv: kv[1]["error"])
        raise Failure(f"{what} memory in {ph} is {r['measured_gib']:.2f} GiB, {-r['error']:.0%} over the plan's "
                      f"{r['plan_gib']:.2f} GiB (band ±{band:.0%})",
                      "runs here need more headroom than planned: keep the plan's verdict 'fits' with margin, and "
                      "report the figures (the JSON report) so the planner's constants can be measured here", data)
    worst = max(rows.items(), key=lambda kv: abs(kv[1]["error"]))
    listing = ", ".join(f"{ph} {r['plan_gib']:.2f}/{r['measured_gib']:.2f}" for ph, r in rows.items())
    return Passed(f"{what} GiB planned/measured per phase: {listing}; worst {worst[0]} {worst[1]['error']:+.1%} "
                  f"(band ±{band:.0%}; + is a plan above the measurement)", data)
