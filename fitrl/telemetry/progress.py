"""Is this process making progress? Heartbeats for the hang watchdog (fitrl/trainer/watchdog.py).

Each process (the driver, every Ray rank) keeps one :data:`PROGRESS`: the phase it is in and the
time of its last heartbeat. The loops that do a phase's work beat once per unit of it (a decode
step, a micro-batch, a scored response, a phase boundary), so a phase that is working beats every
few seconds at most, and one that beats no more is stuck: in a collective whose peer is gone, an
engine that stopped answering, a user's function that never returns. A beat is one clock read and
two stores: free beside the work it marks.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Optional


class Progress:
    def __init__(self) -> None:
        self.phase: Optional[str] = None
        self.last = time.monotonic()
        self.beats = 0
        self.thread: Optional[int] = None  # the thread doing the phase's work (a Ray actor runs calls off its main thread)

    def beat(self) -> None:
        self.last = time.monotonic()
        self.beats += 1

    def enter(self, phase: Optional[str]) -> None:
        self.phase = phase
        self.thread = threading.get_ident()
        self.beat()

    def idle_s(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self.last

    def report(self) -> dict:
        """What the watchdog asks a process: its phase, its idle time and its main thread's stack."""
        return {"phase": self.phase, "idle_s": self.idle_s(), "beats": self.beats, "stack": thread_stack(self.thread)}


PROGRESS = Progress()
"""This process's heartbeats."""


def thread_stack(ident: Optional[int] = None) -> str:
    """The Python stack of thread ``ident`` (default: the main thread), innermost call last."""
    ident = ident if ident is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)\n"
