"""The hang watchdog: a phase with no progress for its limit stops the run, naming where.

A thread of the driver wakes every few seconds during :meth:`RLTrainer.fit`. Progress is the
heartbeats of :mod:`fitrl.telemetry.progress`: the driver's own, and under Ray every rank's, asked
through each actor's ``health`` method, which runs in a thread of its own and so answers while the
rank's main thread is stuck. When neither the driver nor any rank has beaten for the phase's limit
(``trainer.hang_timeout_s``, ``trainer.hang_timeouts``), the watchdog

1. prints the phase, each process's idle time and the Python stack of the thread doing each one's work, and
   writes the same to ``<run_dir>/hang.txt``;
2. records a ``hang`` event in ``metrics.jsonl``;
3. raises :class:`~fitrl.core.errors.Hung` in the main thread (which unwinds through the worker
   groups' shutdown), and if that thread does not come back within :data:`EXIT_GRACE_S` (it is
   stuck in C code: a collective, a ``time.sleep`` in a user's function), ends the process with
   exit status 1: the run directory holds what a next run resumes from.

A rank stuck in a collective waits for its peers, and the report names the others as where to
look. An NCCL collective returns when it is enqueued, so a rank waiting for a peer is rarely seen
in a ``torch.distributed`` frame: it blocks later, at the next host synchronisation (a ``.item()``,
a copy to the host). Each rank therefore also reports how many collectives it has issued (c10d's
per-group sequence numbers): a rank that has issued more than another of its role has entered a
collective that one has not reached, and is waiting in it.

The collectives' own timeout (:func:`collective_timeout_s`) sits above every limit here by
:data:`COLLECTIVE_MARGIN_S`, so the watchdog fires, reports and stops first; NCCL aborting a rank
would end the run as a dead worker, without the stacks.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from fitrl.core.errors import Hung
from fitrl.telemetry.progress import PROGRESS, thread_stack

EXIT_GRACE_S = 20.0
"""How long the main thread has to unwind after the hang is raised in it."""
HEALTH_TIMEOUT_S = 10.0
"""How long a rank's ``health`` call may take before the rank counts as unresponsive."""
MAX_POLL_S = 10.0
"""The longest the watchdog sleeps between checks."""
COLLECTIVE_MARGIN_S = MAX_POLL_S + HEALTH_TIMEOUT_S + EXIT_GRACE_S + 30.0
"""How far the collectives' timeout sits above a phase's limit: the watchdog notices the hang
within one poll, asks the ranks within the health timeout, then gives the main thread its grace;
30 s more for the report and the groups' shutdown on a loaded node."""
UNWATCHED_COLLECTIVE_TIMEOUT_S = 3600.0
"""The collectives' timeout where some phase has no watchdog (``trainer.hang_timeout_s=0``, or a
phase's limit 0): finite, so a dead peer still surfaces, and long, since the watchdog is turned
off for phases that run long (torch's NCCL default, 10 min, would cut a long checkpoint save)."""


def collective_timeout_s(default_s: float, per_phase: dict[str, float]) -> float:
    """The process groups' collective timeout for the watchdog limits ``default_s``
    (``trainer.hang_timeout_s``) and ``per_phase`` (``trainer.hang_timeouts``; 0: off):
    :data:`COLLECTIVE_MARGIN_S` above the largest limit, at least
    :data:`UNWATCHED_COLLECTIVE_TIMEOUT_S` when a phase runs without a watchdog.

    >>> collective_timeout_s(1800, {"checkpoint_save": 3600})
    3670.0
    >>> collective_timeout_s(0, {})
    3600.0
    """
    limits = [default_s, *per_phase.values()]
    timeouts = [float(limit) + COLLECTIVE_MARGIN_S for limit in limits if limit > 0]
    if not default_s or not all(per_phase.values()):
        timeouts.append(UNWATCHED_COLLECTIVE_TIMEOUT_S)
    return max(timeouts)


class HangWatchdog:
    def __init__(self, limits: Callable[[Optional[str]], float], ranks: Callable[[float], list[dict]], *,
                 report: Callable[[str, dict], str], poll_s: Optional[float] = None):
        """``limits(phase)``: seconds without progress that make a hang in ``phase`` (0: never);
        ``ranks(timeout)``: every rank's health (``[]`` in one process); ``report(text, event)``:
        prints and records the hang, returns the resume line for the stop message."""
        self.limits, self.ranks, self.report = limits, ranks, report
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.fired = False

    def __enter__(self) -> "HangWatchdog":
        self._thread = threading.Thread(target=self._run, name="fitrl-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval()):
            try:
                if self.check():
                    return
            except Exception as e:  # the watchdog must never be what breaks a run
                print(f"fitrl: hang watchdog: {type(e).__name__}: {e}", file=sys.stderr)

    def _interval(self) -> float:
        if self.poll_s is not None:
            return self.poll_s
        limit = self.limits(PROGRESS.phase) or 60.0
        return max(0.5, min(MAX_POLL_S, limit / 6))

    def check(self) -> bool:
        """Fire when the current phase has gone without progress past its limit."""
        phase = PROGRESS.phase
        limit = self.limits(phase)
        if phase is None or not limit or PROGRESS.idle_s() < limit:
            return False
        ranks = self.ranks(min(HEALTH_TIMEOUT_S, limit))
        idle = [r["idle_s"] for r in ranks if r.get("idle_s") is not None]
        if min([PROGRESS.idle_s(), *idle]) < limit or PROGRESS.phase != phase:
            return False  # a rank is working, or the phase ended meanwhile
        self.fire(phase, limit, ranks)
        return True

    def fire(self, phase: str, limit: float, ranks: list[dict]) -> None:
        self.fired = True
        stuck = [r for r in ranks if r.get("idle_s") is None or r["idle_s"] >= limit]
        culprits, waiting = split_stuck(stuck)
        names = ", ".join(f"{r['role']} rank {r['rank']}" for r in culprits) or "the driver"
        if waiting and culprits is not waiting:
            names += " (" + ", ".join(f"{r['role']} rank {r['rank']}" for r in waiting) + " waiting in a collective)"
        lines = [f"hang: phase {phase!r} made no progress for {limit:g} s (trainer.hang_timeout_s); stuck: {names}",
                 f"--- driver (pid {os.getpid()}), idle {PROGRESS.idle_s():.0f} s, main thread:",
                 thread_stack().rstrip()]
        for r in ranks:
            where = f"{r['role']} rank {r['rank']} (pid {r.get('pid', '?')}, {r.get('node_ip', '?')})"
            if r.get("idle_s") is None:
                lines.append(f"--- {where}: did not answer within {HEALTH_TIMEOUT_S:g} s ({r.get('error', 'no reply')})")
            else:
                issued = f", {r['collectives']} collectives issued" if r.get("collectives") is not None else ""
                state = " (waiting in a collective)" if r in waiting and culprits is not waiting else ""
                lines.append(f"--- {where}, in {r.get('phase')!r}, idle {r['idle_s']:.0f} s{issued}{state}, "
                             "the thread running it:")
                lines.append(r["stack"].rstrip())
        text = "\n".join(lines)
        event = {"event": "hang", "phase": phase, "limit_s": limit,
                 "ranks": {f"{r['role']}.rank{r['rank']}": r.get("idle_s") for r in ranks}}
        resume = self.report(text, event)
        _raise_in_main(Hung(f"phase {phase!r} made no progress for {limit:g} s ({names}; the stacks are above and in "
                            f"hang.txt); {resume}"))
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            # the main thread took the stop once it has left the watchdog's block (a restart then runs
            # on with a watchdog of its own) or ended
            if self._stop.is_set() or not threading.main_thread().is_alive():
                return
            time.sleep(0.2)
        print(f"fitrl: hang: the main thread is still stuck {EXIT_GRACE_S:g} s after the stop (in C code); "
              f"exiting. {resume}", file=sys.stderr, flush=True)
        os._exit(1)


def split_stuck(stuck: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(culprits, waiting)`` of the stuck ranks' health reports: a rank inside a collective waits
    for the others, and the ones elsewhere (at a Python-level point: a user's function, an engine)
    are where to look. When every rank is waiting (mismatched collectives), all are culprits."""
    ahead = _ahead_in_collectives(stuck)
    waiting = [r for r in stuck if _in_collective(r.get("stack", "")) or any(r is a for a in ahead)]
    culprits = [r for r in stuck if not any(r is w for w in waiting)] or waiting
    return culprits, waiting


def _in_collective(stack: str) -> bool:
    """The innermost frames are a torch.distributed (c10d) collective's call or wait."""
    tail = stack.strip().replace("\\", "/").splitlines()[-4:]
    return any("torch/distributed/" in line or "c10d" in line for line in tail)


def _ahead_in_collectives(ranks: list[dict]) -> list[dict]:
    """The ranks that have issued more collectives than another rank of their role: each entered
    one the other has not reached (under NCCL it returned at enqueue, so its stack shows where it
    then blocked, not the collective). Ranks of different roles share no group: compared apart."""
    ahead = []
    for role in {r["role"] for r in ranks}:
        counted = [r for r in ranks if r["role"] == role and r.get("collectives") is not None]
        least = min((r["collectives"] for r in counted), default=None)
        ahead += [r for r in counted if r["collectives"] > least]
    return ahead


def _raise_in_main(error: BaseException) -> None:
    """Raise ``error`` in the main thread at its next Python instruction."""
    ident = threading.main_thread().ident
    # an exception *class* is what the C API takes: a subclass carrying this instance's message
    cls = type("Hung", (type(error),), {"__init__": lambda self: type(error).__init__(self, str(error))})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(cls))


def write_hang_file(run_dir: Path, text: str) -> None:
    (run_dir / "hang.txt").write_text(text + "\n")
