"""Per-phase wall-clock timing for the driver loop; each phase is also a memory phase.

A phase opened here is timed, recorded by this process's memory recorder (and, through
:func:`fitrl.telemetry.phases.current_phase`, by every Ray rank it calls), and guarded: before a
read-only phase of a step in which no weight has changed yet, the memory guard takes a reading
and may stop the step (:class:`fitrl.telemetry.guard.MemoryPressure`). Updates are finished, and
a crossing during them is noted for the end of the step.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch

from fitrl.core.device import cuda_in_use
from fitrl.core.driver_phases import DRIVER_PHASES
from fitrl.ops.sharing import SKIPPED_PROMPTS
from fitrl.telemetry.guard import GUARD
from fitrl.telemetry.phases import RECORDER, in_phase
from fitrl.telemetry.progress import PROGRESS

MUTATING_PHASES = frozenset({"update", "critic_update"})

SAFE_POINT_CHECKS: list[Callable[[str], None]] = []
"""Called with the phase's name where the guard reads memory: before a phase of a step in which
no weight has changed yet. A check may raise to abandon the step there; the trainer's stop on
SIGINT/SIGTERM registers one (fitrl/trainer/signals.py)."""


class PhaseTimer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.mutated = False  # a weight has changed in this step: no more abandoning it

    @contextmanager
    def phase(self, name: str, guarded: bool = True):
        """``guarded=False``: no guard reading at the start (a phase outside the step's handling)."""
        if name not in DRIVER_PHASES:  # the list trainer.hang_timeouts is checked against
            raise ValueError(f"phase {name!r} is not in fitrl/core/driver_phases.py's DRIVER_PHASES: add it there")
        mutating = name in MUTATING_PHASES
        safe_point = guarded and not (mutating or self.mutated)
        if safe_point:
            for check in SAFE_POINT_CHECKS:
                check(name)
        previous, GUARD.phase = GUARD.phase, name
        PROGRESS.enter(name)
        if safe_point:
            GUARD.check()
        self.mutated |= mutating
        start = time.perf_counter()
        try:
            with in_phase(name), RECORDER.phase(name), SKIPPED_PROMPTS.during(name):
                yield
                # otherwise GPU work is billed to whichever phase syncs next; none in a Ray driver
                # (the work is in the ranks, whose results it has already waited for)
                if cuda_in_use():
                    torch.cuda.synchronize()
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            GUARD.phase = previous
            PROGRESS.enter(previous)
        if mutating:
            GUARD.note()

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = sum(self.times.values())
        return out
