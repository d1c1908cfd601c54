"""SIGINT and SIGTERM during ``fitrl train``: stop at a safe point, keep what can be kept in time.

SIGTERM is what Slurm and Kubernetes send before they preempt a job (and SIGKILL ~30 s later by
default); SIGINT is Ctrl-C. Both are handled the same way:

1. **The first signal** is noted (one line on stderr) and the run goes on to the next safe point:
   before the next phase of a step whose update has not started (the step is abandoned: no
   weight has changed, and its rollout is simply redone after a resume), or the end of the step
   when the signal came during an update or a validation (an update is never cut in half).
2. There it writes an **emergency checkpoint** of the last complete step, if that save should end
   within ``trainer.signal_grace_s`` of the signal (judged by the duration of this run's latest
   save; the first save is always tried: saves are atomic, so being killed in one costs nothing).
   No save when that step is already checkpointed, when nothing was trained since the start or
   the resume, or while a divergence signal is pending (fitrl/trainer/divergence.py). Then the
   run exits with one line: what stopped it, where, and the checkpoint it continues from.
3. **A second signal** stops at once: :class:`Interrupted` is raised wherever the run is, so
   context managers still shut worker groups and reward processes down, and a checkpoint being
   written is dropped (the last complete one is never touched: saves go to a temporary directory
   that is renamed when whole). A third signal kills the process the default way.

A signal before the training loop (loading models, building Ray actors) stops at once: there is
nothing to save. Exit status: 128 + the signal number, 130 for SIGINT and 143 for SIGTERM.

Where a step may be abandoned is decided by the phase timer (fitrl/telemetry/timer.py,
``SAFE_POINT_CHECKS``); what is saved, and the message, by the loop (fitrl/trainer/loop.py).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from fitrl.core.errors import Interrupted
from fitrl.telemetry.phases import current_phase
from fitrl.telemetry.timer import SAFE_POINT_CHECKS

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StepAbandoned(Exception):
    """Raised at a safe point after a stop was requested; caught by :meth:`StopSignals.catch`."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _say(text: str) -> None:
    """A line on stderr from a signal handler: the main thread may be inside a write to the
    same stream, where a second buffered write raises; the raw descriptor always takes it."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (RuntimeError, ValueError, OSError):
        import os

        os.write(2, (text + "\n").encode())


class StopSignals:
    """This process's SIGINT/SIGTERM handling during a run (one instance: :data:`SIGNALS`)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None  # the first signal received
        self.at = 0.0                      # its time.monotonic()
        self.phase: Optional[str] = None   # the phase it arrived in
        self.abandoned = False             # a safe point abandoned the current step
        self.deferring = False             # inside the training loop: the first signal waits for a safe point
        self.loop_done = False             # the training loop has ended (shutting down)
        self.stopped_at_once = False       # a second signal raised wherever the run was
        self._depth = 0
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ installing

    @contextmanager
    def handled(self) -> Iterator[None]:
        """SIGINT and SIGTERM are handled here within the block (signal handlers belong to the
        main thread: elsewhere this does nothing). Re-entering installs the handlers again:
        ``ray.init`` replaces the SIGTERM handler with its own ``sys.exit``."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        outer = self._depth == 0
        if outer:
            self.signum, self.phase, self.abandoned, self.loop_done = None, None, False, False
            self.stopped_at_once = False
            self._previous = {s: signal.getsignal(s) for s in HANDLED}
        self._depth += 1
        self.reinstall()
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                for s, handler in self._previous.items():
                    signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def reinstall(self) -> None:
        """Take SIGINT and SIGTERM back inside :meth:`handled` (after ``ray.init``)."""
        if self._depth and threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                signal.signal(s, self._handle)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """The training loop: the first signal asks for a stop at the next safe point."""
        with self.handled():
            was, self.deferring = self.deferring, True
            SAFE_POINT_CHECKS.append(self._at_safe_point)
            try:
                yield
            finally:
                SAFE_POINT_CHECKS.remove(self._at_safe_point)
                self.deferring, self.loop_done = was, True

    # ------------------------------------------------------------------ handling

    def _handle(self, signum: int, frame) -> None:
        name = signal_name(signum)
        if self.signum is None and self.deferring:
            self.signum, self.at, self.phase = signum, time.monotonic(), current_phase()
            where = f" during {self.phase!r}" if self.phase else ""
            _say(f"fitrl: {name} received{where}: stopping at the next safe point, with an emergency checkpoint "
                 f"if there is time (send it again to stop at once)")
            return
        if self.signum is not None:  # the second: the user (or the scheduler) insists
            for s in HANDLED:  # a third one kills the default way, whatever cleanup is running
                signal.signal(s, signal.SIG_DFL)
            self.stopped_at_once = True
            raise Interrupted(f"stopped at once by a second {name}; a checkpoint being written was dropped, the "
                              "last complete one is untouched", signum)
        self.signum = signum
        raise Interrupted(f"stopped by {name} " + ("while shutting down after training" if self.loop_done else
                                                   "before training started (nothing to save)"), signum)

    def _at_safe_point(self, phase: str) -> None:
        if self.signum is not None:
            self.abandoned = True
            raise StepAbandoned(phase)

    @contextmanager
    def catch(self) -> Iterator[None]:
        """Ends the block quietly at a safe point after a stop was requested (the caller then
        stops the run: :meth:`requested`)."""
        try:
            yield
        except StepAbandoned:
            pass

    def requested(self, *, step_done: bool) -> bool:
        """Should the run stop here? After a complete step (``step_done``): if any signal came;
        right after a step's phases: only if a safe point abandoned it."""
        return self.signum is not None and (step_done or self.abandoned)

    def elapsed(self) -> float:
        return time.monotonic() - self.at


SIGNALS = StopSignals()


def why_not_save(*, done: int, start_step: int, checkpointed: bool, elapsed: float,
                 expected_save_s: Optional[float], grace_s: float, divergence: Optional[str]) -> Optional[str]:
    """Why no emergency checkpoint of step ``done`` is written, or None to write it.

    ``checkpointed``: this run directory has a complete checkpoint of step ``done``;
    ``expected_save_s``: how long this run's latest save took (None: none yet, so try);
    ``divergence``: a pending divergence signal.
    """
    if checkpointed:
        return f"step {done} is checkpointed already"
    if done <= start_step:
        return "nothing was trained since " + (f"the resume at step {start_step}" if start_step else "the start")
    if divergence:
        return f"divergence suspected: {divergence}"
    if grace_s <= 0:
        return "trainer.signal_grace_s=0"
    expected = expected_save_s or 0.0
    if elapsed + expected > grace_s:
        return (f"it would end ~{elapsed + expected:.0f} s after the signal ({expected:.0f} s for the last save), past "
                f"trainer.signal_grace_s={grace_s:g}")
    return None
