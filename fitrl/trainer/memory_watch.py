"""The driver's view of memory during a run: telemetry, leak warnings, guard stops.

Once per step :meth:`MemoryWatch.end_step` drains every process's per-phase records (the
driver's own, and each Ray rank's through its group), turns them into ``mem/...`` metrics and
feeds the leak detector. Guard stops are handled here too, so the loop only marks where a stop
may happen (docs/architecture.md, "Memory during the run"):

- ``with watch.catch(): ...`` notes a guard crossing instead of raising it. Afterwards
  ``watch.stop_if_crossed(step, step_done=...)`` ends the run: a crossing in a read-only phase
  abandons the step (the emergency checkpoint is the previous step); one after the update, or
  one an update could only defer, stops once the step is recorded.
- :meth:`explain` writes the stop message: which memory, where, what held it, which settings help.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from rich.console import Console

from fitrl.config.schema import FitrlConfig
from fitrl.core.device import cuda_in_use
from fitrl.core.errors import RunStopped
from fitrl.telemetry.guard import GUARD, MemoryPressure
from fitrl.telemetry.leaks import LeakDetector
from fitrl.telemetry.memory import GIB, read_memory, trim_heap
from fitrl.telemetry.phases import RECORDER, PhaseMemory, StepReport
from fitrl.workers.group import RoleHandle

log = logging.getLogger(__name__)

# Settings that lower each phase's memory, cheapest in speed first.
KNOBS = {
    "rollout": ["rollout.micro_batch_size (sequences generated at once)", "rollout.max_response_length",
                "data.rollout_batch_size or rollout.n (sequences per step)"],
    "validation": ["data.val_batch_size", "rollout.micro_batch_size", "rollout.val.n"],
    "old_logprob": ["actor.logprob_micro_batch_size", "actor.logprob_chunk_size (logits per chunk)",
                    "actor.micro_batch_token_budget"],
    "ref": ["ref.logprob_micro_batch_size", "actor.logprob_chunk_size", "ref.fsdp.offload_params (GPU)"],
    "teacher_logprob": ["teacher.logprob_micro_batch_size", "actor.logprob_chunk_size", "algorithm.distill.top_k",
                        "teacher.fsdp.offload_params (GPU)"],
    "values": ["critic.values_micro_batch_size"],
    "update": ["actor.micro_batch_size (or actor.micro_batch_token_budget)", "actor.model.gradient_checkpointing=true",
               "actor.fsdp.offload_optimizer (GPU; costs host memory)"],
    "critic_update": ["critic.micro_batch_size", "critic.model.gradient_checkpointing=true"],
    "checkpoint_save": ["checkpoint.model_only=true"],
}
KNOBS["baseline_rollout"] = KNOBS["rollout"]
HOST_KNOBS = ["fewer ranks per node (trainer.devices_per_node)", "reward.num_workers",
              "actor.fsdp.offload_params / offload_optimizer off (host copies of parameters and optimizer states)"]


def report_metrics(report: StepReport) -> dict[str, float]:
    """``mem/<process>/<phase>/<field>`` for every record, and run-wide summaries:
    ``mem/host_peak_gib`` (largest process peak), ``mem/node_available_min_gib``, ``mem/gpu_peak_gib``."""
    m: dict[str, float] = {}
    peak = (0, "", "")
    gpu_peak = (0, "", "")
    available = None
    for process, phases in report.items():
        for phase, rec in phases.items():
            m.update(rec.metrics(f"mem/{process}/{phase}"))
            peak = max(peak, (rec.host_peak, process, phase))
            gpu_peak = max(gpu_peak, (rec.gpu_peak, process, phase))
            available = rec.node_available_min if available is None else min(available, rec.node_available_min)
    if peak[0]:
        m["mem/host_peak_gib"] = peak[0] / GIB
        m["mem/node_available_min_gib"] = available / GIB
    if gpu_peak[0]:
        m["mem/gpu_peak_gib"] = gpu_peak[0] / GIB
    return m


EmergencySave = Callable[[int, dict, dict], Optional[Path]]
"""``save(step, driver_state, metrics)``: writes the checkpoint of a complete step, returns its path."""


class MemoryWatch:
    def __init__(self, cfg: FitrlConfig, roles: dict[str, RoleHandle], console: Console, *,
                 write: Callable[[dict], None] = lambda record: None, save: Optional[EmergencySave] = None):
        self.cfg, self.roles, self.console = cfg, roles, console
        self.write, self.save = write, save  # metrics.jsonl records; the emergency checkpoint
        self.crossed: Optional[MemoryPressure] = None
        m = cfg.memory
        self.remote = cfg.trainer.backend == "ray"
        # In-process, the driver hosts rank 0 of every role: its records are rank 0's.
        self.driver = "driver" if self.remote else "rank0"
        GUARD.configure(m, process=self.driver)  # and the recorder
        RECORDER.drain(end_of_step=False)  # what model loading left is not step 1's
        # 30 steps pin a phase's rate within 20 % under allocator noise (fitrl.telemetry.leaks)
        self.detector = LeakDetector(warmup_steps=m.leak_warmup_steps, window=m.leak_window,
                                     min_rate_mib=m.leak_min_rate_mib,
                                     min_points=min(30, m.leak_window)) if m.telemetry else None
        self.last: StepReport = {}
        self.warnings = 0

    def collect(self) -> tuple[StepReport, Optional[MemoryPressure]]:
        report: StepReport = {self.driver: RECORDER.drain()}
        pressure = GUARD.take_deferred()
        if self.remote:
            for name, handle in self.roles.items():
                for rank, (records, deferred) in enumerate(handle.group.memory_reports()):
                    report[f"{name}.rank{rank}"] = records
                    pressure = pressure or deferred
        return {k: v for k, v in report.items() if v}, pressure

    @contextmanager
    def catch(self) -> Iterator[None]:
        """Notes a guard crossing in the block instead of raising it (:meth:`stop_if_crossed` acts).

        The exception is dropped here, with its traceback: its frames hold the abandoned step's
        batch, which the stop frees before it writes a checkpoint.
        """
        try:
            yield
        except MemoryPressure as p:
            self.crossed = self.crossed or p.with_traceback(None)

    def end_step(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """This step's memory metrics and the leak warnings raised (as records for metrics.jsonl);
        a crossing an update deferred is noted for :meth:`stop_if_crossed`."""
        GUARD.note()
        report, pressure = self.collect()
        self.crossed = self.crossed or pressure
        self.last = report or self.last
        metrics = report_metrics(report)
        events = []
        if self.detector is not None:
            for w in self.detector.observe(step, report, max_steps=self.cfg.trainer.max_steps):
                self.warnings += 1
                log.info(w.message())  # the console line below is the user-facing one
                self.console.print(f"[yellow]warning:[/] {w.message()}", highlight=False)
                events.append({"step": step, "event": "memory_leak", **dataclasses.asdict(w), "message": w.message()})
            metrics["mem/leak_warnings"] = float(self.warnings)
        return metrics, events

    def stop_if_crossed(self, step: int, *, step_done: bool, state: Optional[dict], metrics: Optional[dict] = None):
        """Ends the run with :class:`RunStopped` if a crossing was noted: frees what the step held,
        writes the emergency checkpoint of the last complete step (``state``: the driver's state
        then; None writes none), records the stop in metrics.jsonl and explains it."""
        pressure, self.crossed = self.crossed, None
        if pressure is None:
            return
        gc.collect()  # the abandoned step's batch and activations
        trim_heap()
        if cuda_in_use():  # (a Ray driver holds no CUDA cache: the ranks free their own)
            torch.cuda.empty_cache()
        done = step if step_done else step - 1
        path = None
        if state is not None and self.save is not None:
            try:
                path = self.save(done, state, metrics or {})
            except Exception as e:  # the message says so; earlier checkpoints are untouched (atomic saves)
                self.console.print(f"[red]emergency checkpoint of step {done} failed:[/] {type(e).__name__}: {e}")
        if state is not None:
            self.write({"step": step, "event": "memory_guard_stop", "kind": pressure.kind, "phase": pressure.phase,
                        "process": pressure.process, "available_gib": pressure.available / 2**30,
                        "checkpoint": str(path) if path else None})
        raise RunStopped(self.explain(pressure, step_done=step_done, checkpoint=str(path) if path else None,
                                      step=step))

    def explain(self, p: MemoryPressure, *, step_done: bool, checkpoint: Optional[str], step: int) -> str:
        """The stop message: memory kind, phase and process, what held it, knobs, the checkpoint."""
        lines = [f"memory guard: {p}"]
        held = []
        now = read_memory(uss=False)
        try:
            current, _ = self.collect()  # the phases of the step being stopped, where they ran
        except Exception:  # a rank that cannot answer must not hide the explanation
            current = {}
        report = {proc: {**self.last.get(proc, {}), **current.get(proc, {})} for proc in {*self.last, *current}}
        for proc, phases in sorted(report.items()):
            last: PhaseMemory = list(phases.values())[-1]
            top = max(phases.items(), key=lambda kv: kv[1].host_peak)
            text = f"{proc} {last.host_rss / GIB:.2f} GiB RSS (peak {top[1].host_peak / GIB:.2f} in {top[0]!r})"
            if last.gpu_total:
                gtop = max(phases.items(), key=lambda kv: kv[1].gpu_peak)
                text += f", GPU {last.gpu_allocated / GIB:.1f} GiB allocated (peak {gtop[1].gpu_peak / GIB:.1f} in {gtop[0]!r})"
            held.append(text)
        if not report:  # stopped before any phase ended: this process's reading now
            held.append(f"{self.driver} {now.host_rss / GIB:.2f} GiB RSS")
        if held:
            ours = sum(list(phases.values())[-1].host_rss for phases in report.values()) or now.host_rss
            other = now.node_total - now.node_available - ours
            held.append(f"everything else on the node ~{max(other, 0) / GIB:.1f} GiB")
            lines.append("held (latest phases): " + "; ".join(held))
        lines.append(f"step {step} " + ("completed (its update had started and was finished)" if step_done
                                        else "was abandoned before any weight changed"))
        if checkpoint:
            lines.append(f"emergency checkpoint: {checkpoint} (step {step if step_done else step - 1}); continue "
                         f"with checkpoint.resume={checkpoint} once memory is freed or the settings changed")
        else:
            lines.append("no emergency checkpoint was written (see above); the newest earlier checkpoint is intact")
        knobs = list(KNOBS.get(p.phase or "", []))
        if p.kind == "host":
            knobs += HOST_KNOBS
        if knobs:
            lines.append(f"settings that lower {'GPU' if p.kind == 'gpu' else 'host'} memory"
                         + (f" in {p.phase!r}" if p.phase else "") + ": " + "; ".join(knobs))
        lines.append("`fitrl plan CONFIG` predicts each phase's memory for a changed config; "
                     "memory.guard_min_available_gib / guard_gpu_max_fraction set the guard's limits")
        return "\n  ".join(lines)
