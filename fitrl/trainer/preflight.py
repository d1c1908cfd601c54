"""``fitrl train``'s memory plan before any model loads.

:func:`preflight` plans the run for the hardware this process sees, or a Ray run's cluster (as ``fitrl plan`` would with
that hardware) and, per ``memory.plan``: ``enforce`` stops a run predicted not to fit, printing
the plan and the cheapest change that fits; ``warn`` prints the same and goes on; ``off`` skips
it. A run that fits gets one line. The planner is a prediction, not a gate on its own bugs: any
failure inside it other than a configuration error is reported in one line and training goes on.
The config's ``rollout.*`` keys, ``plan.emulate`` and the rest are read as ``fitrl plan`` reads them;
``plan.hardware`` is not (it describes other machines, for ``fitrl plan``).

Cost on a 2-core CPU, ``examples/arith.yaml`` with the 31.7M ``small`` model and an empty cache, in
a process that has made ``fitrl train``'s own imports: 1.7-2.6 s (2.4 s under ``FakeTensorMode``),
of which about 0.9 s imports the model's transformers modules, which loading it does anyway, and
0.8-1.0 s traces the micro-steps on the meta device (1.6-2.7 s under ``FakeTensorMode``;
``bench/trace_speed.py``: 2.6x); recommendations are searched
only when the run does not fit (each re-plans the run). The outcome is cached on disk
(:mod:`fitrl.memory.cache`, keyed by the config, the models' ``config.json``, the detected
hardware and the code): a repeat of a config costs the key and a read, 14-18 ms.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Optional

from rich.console import Console

from fitrl.config import ConfigError, FitrlConfig
from fitrl.core.device import cluster, resolve_device
from fitrl.core.device import gpu_memory as device_memory
from fitrl.core.errors import RunStopped
from fitrl.memory import cache as plan_cache
from fitrl.memory import calibration as C
from fitrl.memory.lengths import expected_lengths
from fitrl.memory.model import Hardware, Plan
from fitrl.planner.plan import plan_config
from fitrl.planner.recommend import as_overrides, recommend
from fitrl.planner.report import print_plan
from fitrl.models.description import RunModels
from fitrl.models.shape import ModelShape
from fitrl.telemetry.memory import node_total_bytes

log = logging.getLogger(__name__)


def detect_hardware(cfg: FitrlConfig) -> Hardware:
    """The hardware this run will use, read from this process, or in a Ray run's driver from the
    cluster (it never touches CUDA: fitrl/core/device.py).

    Device: ``trainer.device`` (``auto``: CUDA when this process, or the Ray cluster, has it, as the
    run resolves it; ``cuda`` without CUDA is a ConfigError, as in the run); nodes and devices per
    node: ``trainer.nnodes`` x ``trainer.devices_per_node`` under ``trainer.backend=ray``, one under
    ``inprocess``; device memory: CUDA device 0's, or one cluster GPU's (read by a Ray task holding
    it); host memory: this machine's RAM, or that GPU's node's. Under Ray every node is taken to be
    like that one (a running cluster's other nodes are not asked): plan other machines with
    ``fitrl plan --host-memory ...``.
    """
    t = cfg.trainer
    device = resolve_device(t.device).type
    per_node = t.devices_per_node if t.backend == "ray" else 1
    gpu_memory, host_memory = (device_memory() if device == "cuda" else 0), node_total_bytes()
    remote = cluster()
    if remote is not None and device == "cuda":  # the ranks' nodes, not a head node that may have no GPU
        host_memory = remote.facts().host_memory
    return Hardware(nodes=t.nnodes if t.backend == "ray" else 1, gpus_per_node=per_node, gpu_memory=gpu_memory,
                    host_memory=host_memory, device=device)


def preflight(cfg: FitrlConfig, console: Optional[Console] = None, supervised: bool = False,
              models: Optional[RunModels] = None) -> Optional[Plan]:
    """Plan ``cfg`` on this machine before any model loads; returns the :class:`~fitrl.memory.model.Plan`
    (None with ``memory.plan=off`` or when the planner could not plan this run). ``supervised``: a
    ``fitrl sft`` run, planned with the processes it starts (fitrl/config/layout.py). ``models``:
    the run's model descriptions, the policy's shape read from them (else from its directory).

    Raises :class:`~fitrl.core.errors.RunStopped` with ``memory.plan=enforce`` when it does not fit.
    """
    mode = cfg.memory.plan
    if mode == "off":
        return None
    console = console or Console(soft_wrap=True)
    if any(v is not None for v in dataclasses.asdict(cfg.plan.hardware).values()):
        console.print("note: plan.hardware is read by `fitrl plan`; `fitrl train` plans for the hardware it runs on",
                      highlight=False)
    start = time.perf_counter()
    try:
        hardware = detect_hardware(cfg)
        # read before the key (plan.expected_prompt_length=auto samples the data): a changed dataset is a new key
        lengths = expected_lengths(cfg)
        sft = ["supervised"] if supervised else []  # (`fitrl sft` starts other processes than its config's RL run)
        key = plan_cache.plan_key(cfg, hardware, extra=["preflight", dataclasses.asdict(lengths), *sft])
        cached = plan_cache.load(key)
        if cached is not None:  # the same config, models, hardware and code: the same plan
            plan, recs, combo = cached
            plan = dataclasses.replace(plan, cfg=cfg)  # differs only in keys the planner does not read
        else:
            # the plan at expected lengths even when the caps fit: plan.json keeps it, and `fitrl report`
            # holds the run's measurements against it (0.2-0.3 s more on a first launch)
            shape = models.actor.shape if models is not None else ModelShape.from_path(cfg.actor.model.path)
            plan = plan_config(cfg, hardware, shape=shape, lengths=lengths, supervised=supervised)
            # Recommendations re-plan the run once per candidate change: only worth it when it does not fit.
            recs, combo = ([], None) if plan.verdict == "fits" else recommend(plan, first_fit=True)
            plan_cache.store(key, (plan, recs, combo))
    except ConfigError:
        raise
    except Exception as e:  # a planner gap (e.g. a model type it does not model) must not block training
        log.debug("memory plan skipped", exc_info=True)  # the traceback, for whoever enables debug logging
        console.print(f"memory plan skipped: {type(e).__name__}: {e}", highlight=False)
        return None
    log.info("memory plan took %.2f s%s", time.perf_counter() - start, " (cached)" if cached is not None else "")
    if plan.verdict == "fits":
        console.print(fits_line(plan), highlight=False)
        return plan

    print_plan(plan, recs, combo, console)
    best = next((r for r in recs if r.fits), combo)
    if plan.fits:  # tight: the limit is inside the plan's band; the guard stops the run cleanly if it comes
        fix = f"; for room: {' '.join(as_overrides(best.change))} ({best.change.cost})" if best is not None else ""
        guard = "" if cfg.memory.guard else " (memory.guard=false: nothing will stop it before the OS does)"
        console.print(f"[bold yellow]warning[/]: memory plan is tight: {problem_text(plan)}; going on, the guard "
                      f"armed{guard}{fix}", highlight=False)
        return plan
    if mode == "enforce":
        raise RunStopped(stop_message(plan, best))
    console.print(f"[bold yellow]warning[/]: {problem_text(plan)}; going on because memory.plan=warn",
                  highlight=False)
    return plan


def fits_line(plan: Plan) -> str:
    """``memory plan: fits, peak host 0.5 of 23.5 GiB per node (update), GPU – ...``: one line for a run
    that fits, its peaks at the length caps."""
    peaks = plan.peaks()
    host_phase = max(peaks, key=lambda ph: peaks[ph][1])
    hw = plan.hardware
    host = f"peak host {_gib(peaks[host_phase][1])} of {_gib(hw.host_memory)} GiB per node ({host_phase})"
    if hw.device == "cuda":
        gpu_phase = max(peaks, key=lambda ph: peaks[ph][0])
        gpu = f"GPU {_gib(peaks[gpu_phase][0])} of {_gib(hw.gpu_memory)} GiB per device ({gpu_phase})"
    else:
        gpu = "GPU –"
    # (fits: every peak fits at the caps too, so the caps' figures are the line's; plan.json and
    # `fitrl plan` keep the expected lengths' as well)
    return f"memory plan: fits, {host}, {gpu}; `fitrl plan` on this config shows the table"


def problem_text(plan: Plan) -> str:
    """The worst problem in words: resource, phase, need and band against the limit, the process
    that takes most of it."""
    problems = plan.problems()
    p = max(problems, key=lambda q: q.need / q.limit)
    when = f" from step {p.step}" if p.step else ""
    if p.resource == "gpu":
        what = f"GPU memory per device in {p.phase}{when}"
        total = plan.hardware.gpu_memory
    else:
        what = f"host memory on node 0 in {p.phase}{when}"
        total = plan.hardware.host_memory
    at = f" at expected lengths ({plan.lengths.describe()})" if p.at == "expected" else (
        " at the caps" if plan.expected is not None else "")
    said = "predicted not to fit" if p.call == "does not fit" else "within the plan's band of the limit"
    text = (f"{said}: {what}{at}: {_gib(p.need)} GiB ±{p.band:.0%} against {_gib(p.limit)} GiB usable "
            f"({p.limit / total:.0%} of {_gib(total)} GiB)")
    biggest = _largest_process(plan.expected if p.at == "expected" else plan, p.resource, p.phase)
    text += f", mostly {biggest}" if biggest else ""
    others = sorted({q.phase for q in problems} - {p.phase}, key=list(plan.phases).index)
    return text + (f"; also over in {', '.join(others)}" if others else "")


def stop_message(plan: Plan, best) -> str:
    """The RunStopped message: the problem, the cheapest change that fits, the override."""
    lines = [problem_text(plan)]
    if best is not None:
        lines.append(f"cheapest change that fits: {' '.join(as_overrides(best.change))} ({best.change.cost})")
    else:
        lines.append("no change the planner knows makes it fit: more or larger devices or nodes, or a smaller model")
    lines.append("to train anyway: add memory.plan=warn")
    return "\n".join(lines)


def _largest_process(plan: Plan, resource: str, phase: str) -> str:
    """``trainer rank x 8 (1,500.0 GiB)``: the process kind with the most of ``resource`` in ``phase``."""
    names = {"trainer": "trainer rank", "ref": "reference rank", "critic": "critic rank", "engine": "rollout engine",
             "driver": "driver", "node": "node services", "rank0": "rank 0's load/save copies"}
    best, most = "", 0
    for proc in plan.processes:
        if phase not in proc.phases:
            continue
        usage = proc.phases[phase]
        one = sum((usage.gpu if resource == "gpu" else usage.host).values())
        count = 1 if resource == "gpu" or proc.kind in ("driver", "node", "rank0") else proc.per_node
        if one * count > most:
            best, most = names.get(proc.kind, proc.kind) + (f" x {count}" if count > 1 else ""), one * count
    return f"{best} ({_gib(most)} GiB)" if best else ""


PLAN_FILE = "plan.json"
"""The plan's predictions, saved in the run directory so ``fitrl report`` can draw them against
what the run measured (the run directory is made after the plan, so :func:`write_plan` is separate)."""


def plan_record(plan: Plan) -> dict:
    """The plan as plain JSON: per process kind and phase the predicted GPU (per device) and host
    (per process) peaks in GiB, at the caps (``processes``) and at the expected lengths
    (``expected_processes``, where they are shorter), the node-wide peaks per phase and the limits
    the verdict used."""
    phases = plan.phases
    hw = plan.hardware
    lengths = plan.lengths

    def processes(p: Plan) -> dict:
        return {pp.kind: {"per_node": pp.per_node, "phases": {
            ph: {"gpu_gib": sum(pp.phases[ph].gpu.values()) / C.GIB, "host_gib": sum(pp.phases[ph].host.values()) / C.GIB}
            for ph in phases if ph in pp.phases}} for pp in p.processes}

    return {
        "fits": plan.fits,
        "verdict": plan.verdict,
        "lengths": None if lengths is None else dataclasses.asdict(lengths),
        "expected_node_peaks_gib": None if plan.expected is None else {
            ph: {"gpu": gpu / C.GIB, "host": host / C.GIB} for ph, (gpu, host) in plan.expected.peaks().items()},
        "hardware": {"device": hw.device, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node,
                     "gpu_memory_gib": hw.gpu_memory / C.GIB, "host_memory_gib": hw.host_memory / C.GIB},
        "limits_gib": {"gpu": plan.gpu_limit / C.GIB, "host": plan.host_limit / C.GIB},
        "phases": phases,
        "processes": processes(plan),
        "expected_processes": None if plan.expected is None else processes(plan.expected),
        "node_peaks_gib": {ph: {"gpu": gpu / C.GIB, "host": host / C.GIB} for ph, (gpu, host) in plan.peaks().items()},
        "host_growth_gib_per_step": plan.growth_per_step / C.GIB,
    }


def write_plan(plan: Plan, path: Path) -> None:
    path.write_text(json.dumps(plan_record(plan), indent=1) + "\n")


def _gib(n: float) -> str:
    return f"{n / C.GIB:,.1f}"
