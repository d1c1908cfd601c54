"""Per-phase memory records of one process.

Every process of a run (the driver, each Ray rank) has one :data:`RECORDER`. A phase is what
the driver times (``rollout``, ``old_logprob``, ``ref``, ``values``, ``critic_update``,
``update``, ``validation``, ``checkpoint_save``): the driver's :class:`PhaseTimer` opens it,
and a Ray rank opens the same name around each call the driver makes during it (the name
travels with the call, see :func:`current_phase`). At each phase's start CUDA's peak counter is
reset and the host peak's source armed (``memory.phase_peaks``: the kernel's high-water mark left
alone plus a sampling helper process, or the mark rewound; :mod:`fitrl.telemetry.memory`); at its end one
reading is taken. The driver drains every process's records once per step.

Readings at phase boundaries are the cheap kind (kernel counters, ~0.2 ms a phase). USS, a walk of the
page tables (~14 ms per GiB of RSS: 38 ms at 2.8 GiB, several phases a step), is read once every
``uss_every`` steps when the step's records are drained, and put on the step's last phase; and
at the end of the next phase after the guard saw the node's memory near its threshold
(:meth:`PhaseRecorder.want_uss`). ``uss_min_s`` brings back a reading after every phase at least
that long, for a per-phase breakdown.
"""

from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from fitrl.core.device import cuda_in_use
from fitrl.telemetry.memory import GIB, peak_rss_bytes, read_memory, reset_peak_rss, uss_bytes
from fitrl.telemetry.peak_sampler import SAMPLER

_CURRENT_PHASE: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("fitrl_phase", default=None)


def current_phase() -> Optional[str]:
    """The phase the driver is in (None outside phases); sent along with calls to Ray ranks."""
    return _CURRENT_PHASE.get()


@contextmanager
def in_phase(name: str) -> Iterator[None]:
    token = _CURRENT_PHASE.set(name)
    try:
        yield
    finally:
        _CURRENT_PHASE.reset(token)


@dataclass
class PhaseMemory:
    """Memory of one process over one phase of one step, in bytes (GPU fields 0 without CUDA).

    ``*_retained`` is what the phase left allocated (end minus start, summed over the phase's
    calls in the step): the per-phase signal leak detection attributes growth with.
    """

    calls: int
    host_rss: int            # at the end of the phase
    host_retained: int
    host_peak: int           # RSS high-water mark during the phase (see PhaseRecorder.phase_peaks)
    host_uss: int            # at the end (of the step, on its last phase); 0 where not read, see PhaseRecorder
    node_available: int      # at the end
    node_available_min: int  # lowest seen at the phase's boundaries
    node_total: int
    gpu_allocated: int = 0
    gpu_retained: int = 0
    gpu_reserved: int = 0
    gpu_peak: int = 0
    gpu_total: int = 0
    # the caching allocator's high-water mark (what it held, free blocks included: allocated plus
    # fragmentation) and the device's use at the end as the driver sees it (reserved plus the CUDA
    # context, cuBLAS workspaces and any other process): the plan's GPU figure is the latter's kind
    gpu_peak_reserved: int = 0
    gpu_device_used: int = 0

    def merge(self, later: "PhaseMemory") -> "PhaseMemory":
        """This phase called again within the same step (DAPO rounds, ReMax's greedy pass)."""
        return PhaseMemory(
            calls=self.calls + later.calls, host_rss=later.host_rss,
            host_retained=self.host_retained + later.host_retained, host_peak=max(self.host_peak, later.host_peak),
            host_uss=later.host_uss or self.host_uss, node_available=later.node_available,
            node_available_min=min(self.node_available_min, later.node_available_min), node_total=later.node_total,
            gpu_allocated=later.gpu_allocated, gpu_retained=self.gpu_retained + later.gpu_retained,
            gpu_reserved=later.gpu_reserved, gpu_peak=max(self.gpu_peak, later.gpu_peak), gpu_total=later.gpu_total,
            gpu_peak_reserved=max(self.gpu_peak_reserved, later.gpu_peak_reserved),
            gpu_device_used=later.gpu_device_used)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}/host_rss_gib`` ... in GiB (the units of the console and metrics.jsonl)."""
        m = {f"{prefix}/host_rss_gib": self.host_rss / GIB, f"{prefix}/host_peak_gib": self.host_peak / GIB,
             f"{prefix}/node_available_gib": self.node_available / GIB}
        if self.host_uss:
            m[f"{prefix}/host_uss_gib"] = self.host_uss / GIB
        if self.gpu_total:
            m.update({f"{prefix}/gpu_allocated_gib": self.gpu_allocated / GIB,
                      f"{prefix}/gpu_reserved_gib": self.gpu_reserved / GIB,
                      f"{prefix}/gpu_peak_gib": self.gpu_peak / GIB,
                      f"{prefix}/gpu_peak_reserved_gib": self.gpu_peak_reserved / GIB,
                      f"{prefix}/gpu_device_used_gib": self.gpu_device_used / GIB})
        return m


StepReport = dict[str, dict[str, PhaseMemory]]
"""One step's records: process label (``rank0``, ``driver``, ``policy.rank1``) -> phase -> memory."""


class PhaseRecorder:
    """Records :class:`PhaseMemory` per phase name until :meth:`drain`; nested phases (the
    in-process worker call inside the driver's phase) are counted once, by the outermost.

    USS (``host_uss``) is read where it is worth its page-table walk: at every ``uss_every``-th
    end-of-step drain since :meth:`configure` (the 1st, ``uss_every + 1``-th, ...; 0: never; a
    resumed run counts from its first step), on the last phase's record;
    at the end of the phase after :meth:`want_uss`; and, with ``uss_min_s`` set, after every
    phase at least that long.

    ``phase_peaks`` says where a phase's peak RSS comes from. ``sample`` (the default) never
    touches the kernel's high-water mark, so ``/usr/bin/time -v`` still reports the process's
    peak: a phase that raises the mark reads its peak from it, exactly; any other phase's peak is
    the largest RSS :attr:`sampler`'s helper process saw in it (every 5 ms; a lower bound, under
    the truth only by a spike briefer than that). ``rewind`` rewinds the mark at each phase's
    start: exact for every phase (the calibration benches use it), the kernel's lifetime figure
    lost (the process's own ``mem/host_peak_rss_gib`` keeps it).
    """

    def __init__(self) -> None:
        self.records: dict[str, PhaseMemory] = {}
        self.enabled = True
        self.uss_every = 10
        self.uss_min_s: Optional[float] = None
        self.phase_peaks = "sample"
        self.sampler = SAMPLER
        self._uss_wanted = False
        self._steps = 0  # end-of-step drains so far
        self._depth = 0

    def configure(self, enabled: bool, uss_every: int, uss_min_s: Optional[float],
                  phase_peaks: str = "sample") -> None:
        """Settings for a run (``memory.*``); its steps are counted from here."""
        self.enabled, self.uss_every, self.uss_min_s = enabled, uss_every, uss_min_s
        self.phase_peaks = phase_peaks
        self._steps, self._uss_wanted = 0, False

    def want_uss(self) -> None:
        """Read USS at the end of the current (or next) phase: the guard found memory near its limit."""
        self._uss_wanted = True

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        cuda = cuda_in_use()  # (never in a Ray driver: its ranks' GPU work is theirs to record)
        start = read_memory(uss=False)
        rewind = self.phase_peaks == "rewind"
        if rewind:
            reset_peak_rss()
        else:
            mark_before = peak_rss_bytes()
            self.sampler.arm()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self._depth += 1
        began = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            long_phase = self.uss_min_s is not None and time.perf_counter() - began >= self.uss_min_s
            uss = self._uss_wanted or long_phase
            if uss:
                self._uss_wanted = False
            if rewind:
                host_peak = peak_rss_bytes()
            else:
                sampled, mark = self.sampler.disarm(), peak_rss_bytes()
                host_peak = mark if mark > mark_before else max(sampled, start.host_rss)
            end = read_memory(uss=uss)
            rec = PhaseMemory(
                calls=1, host_rss=end.host_rss, host_retained=end.host_rss - start.host_rss,
                host_peak=max(host_peak, end.host_rss), host_uss=end.host_uss,
                node_available=end.node_available, node_available_min=min(start.node_available, end.node_available),
                node_total=end.node_total, gpu_allocated=end.gpu_allocated,
                gpu_retained=end.gpu_allocated - start.gpu_allocated, gpu_reserved=end.gpu_reserved,
                gpu_peak=torch.cuda.max_memory_allocated() if cuda else 0, gpu_total=end.gpu_total,
                gpu_peak_reserved=torch.cuda.max_memory_reserved() if cuda else 0,
                gpu_device_used=end.gpu_device_used)
            self.records[name] = self.records[name].merge(rec) if name in self.records else rec

    def drain(self, end_of_step: bool = True) -> dict[str, PhaseMemory]:
        """The records since the last drain. ``end_of_step``: a step's records (counted for
        ``uss_every``), not what came before the first step."""
        out, self.records = self.records, {}
        if end_of_step and out:
            self._steps += 1
            if self.uss_every and (self._steps - 1) % self.uss_every == 0:
                last = out[next(reversed(out))]  # the step's last phase, as the leak detector reads it
                last.host_uss = last.host_uss or uss_bytes()
        return out


RECORDER = PhaseRecorder()
"""This process's recorder (one per process: the driver's, or a Ray rank's)."""
