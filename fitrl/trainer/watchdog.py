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
        return max(0.5, min(10.0, limit / 6))

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
        # a rank inside a collective waits for the others: the ones elsewhere are where to look
        waiting = [r for r in stuck if _in_collective(r.get("stack", ""))]
        culprits = [r for r in stuck if r not in waiting] or waiting
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
                lines.append(f"--- {where}, in {r.get('phase')!r}, idle {r['idle_s']:.0f} s, the thread running it:")
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


def _in_collective(stack: str) -> bool:
    """The innermost frames are a torch.distributed collective's wait."""
    tail = stack.strip().splitlines()[-4:]
    return any("torch/distributed/" in line for line in tail)


def _raise_in_main(error: BaseException) -> None:
    """Raise ``error`` in the main thread at its next Python instruction."""
    ident = threading.main_thread().ident
    # an exception *class* is what the C API takes: a subclass carrying this instance's message
    cls = type("Hung", (type(error),), {"__init__": lambda self: type(error).__init__(self, str(error))})
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(cls))


def write_hang_file(run_dir: Path, text: str) -> None:
    (run_dir / "hang.txt").write_text(text + "\n")
