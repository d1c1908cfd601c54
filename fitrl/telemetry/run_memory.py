"""Memory outside the steps, recorded in metrics.jsonl: the models' load before the first step,
and what runs after the last step's record (the final validation, the final checkpoint save).

A step's record carries the memory of its phases (``mem/<process>/<phase>/...``, drained at the
step's end: fitrl/trainer/memory_watch.py); the load comes before any step and the final
validation and save after the last one, so each is an event record of its own::

    {"step": 0, "event": "memory", "at": "load", "mem/rank0/load/host_peak_gib": 0.41, ...}
    {"step": 20, "event": "memory", "at": "end", "mem/rank0/validation/host_peak_gib": 0.52,
     "mem/rank0/checkpoint_save/host_peak_gib": 0.55, ...}

The load is recorded once per run, before step 1 (a resume's is not: see :meth:`LoadMemory.write`),
in the process that runs the loop: in-process, rank 0, which loads every
model; under Ray the driver (the ranks load in their own processes, outside any phase the driver
names, and their first records are step 1's).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fitrl.telemetry.phases import RECORDER, PhaseMemory, StepReport


class LoadMemory:
    """``with load: <build the worker groups>``, then :meth:`write` once the run's writer exists.
    The block is a memory phase of this process's recorder (its peak, sampled as any phase's:
    fitrl/telemetry/phases.py), taken out of the recorder at once, so step 1's records stay its own."""

    PHASE = "load"

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.record: Optional[PhaseMemory] = None
        self._phase: Any = None

    def __enter__(self) -> "LoadMemory":
        if self.enabled:
            self._phase = RECORDER.phase(self.PHASE)
            self._phase.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._phase is not None:
            self._phase.__exit__(*exc)
            self._phase = None
            self.record = RECORDER.records.pop(self.PHASE, None)

    def write(self, write: Callable[[dict], None], process: str, resumed: bool = False) -> None:
        """The load's event record, at step 0; nothing when it was not recorded, or for a resumed
        run: its metrics.jsonl reads as one run, record for record the uninterrupted run's
        (tests/test_checkpoint_resume.py), whose load is the one before step 1."""
        if self.record is not None and not resumed:
            write(memory_event({process: {self.PHASE: self.record}}, 0, "load"))


def memory_event(report: StepReport, step: int, at: str) -> dict:
    """``{"step": step, "event": "memory", "at": at, "mem/<process>/<phase>/<field>": ...}``."""
    out: dict[str, Any] = {"step": step, "event": "memory", "at": at}
    for process, phases in report.items():
        for phase, rec in phases.items():
            out.update(rec.metrics(f"mem/{process}/{phase}"))
    return out


def write_end_memory(write: Callable[[dict], None], collect: Callable[[], tuple[StepReport, Any]], step: int) -> None:
    """After the loop: the records no step drained (the final validation, the final save), from
    every process ``collect`` asks (``MemoryWatch.collect``), as one event record at ``step``."""
    report, _ = collect()  # (a guard crossing noted now has nothing left to stop)
    if report:
        write(memory_event(report, step, "end"))
