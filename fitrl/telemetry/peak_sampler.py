"""The largest RSS of this process within a phase, without touching the kernel's high-water mark.

A small helper process (started on first use, one per fitrl process) reads this process's
``/proc/<pid>/statm`` every ``interval_s`` and keeps the largest value since the latest
:meth:`PeakSampler.arm`, in 32 bytes of shared memory. It is a process, not a thread, because a
thread needs the GIL for each reading: in a run whose steps are Python-bound (the tiny models'
decode loop) the handovers cost 10-15 % of the step time whatever the interval, while the
process costs one core ~35 us per reading (1.2-1.7 % of a core at 5 ms, nothing between phases)
and the parent a few 8-byte reads and writes per phase. The helper is a bare interpreter
(``-I -S``: ~9 MiB RSS), exits when its parent does, and a fork's child starts its own.

Shared layout (little-endian ``uint64``): [0] the parent's arming count, [8] the largest RSS in
bytes since the helper saw that count, [16] the count that maximum belongs to (written after it,
so a reader that finds its own count at [16] reads a maximum of its own phase), [24] 1 while a
phase is open. Between phases the helper blocks on a pipe that :meth:`PeakSampler.arm` writes a
byte to, so it costs nothing then, and it sees its parent's end close when the parent exits.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import struct
import subprocess
import sys
from typing import Optional

log = logging.getLogger(__name__)

_HELPER = r"""
import mmap, os, struct, sys, time
pid, fd, wake, interval = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
shared = mmap.mmap(fd, 32)
page = os.sysconf("SC_PAGE_SIZE")
try:
    statm = os.open("/proc/%d/statm" % pid, os.O_RDONLY)
except OSError:
    sys.exit(0)
seen, top = -1, 0
while os.getppid() == pid:
    if not struct.unpack_from("<Q", shared, 24)[0]:
        if not os.read(wake, 4096):  # between phases: asleep until the next arm writes; EOF: the parent is gone
            break
        continue
    arming = struct.unpack_from("<Q", shared, 0)[0]
    try:
        rss = int(os.pread(statm, 128, 0).split()[1]) * page
    except (OSError, ValueError, IndexError):
        break
    if arming != seen:  # a new phase: its first reading, then whose it is
        top, seen = rss, arming
        struct.pack_into("<Q", shared, 8, top)
        struct.pack_into("<Q", shared, 16, seen)
    elif rss > top:
        top = rss
        struct.pack_into("<Q", shared, 8, top)
    time.sleep(interval)
"""


class PeakSampler:
    """:meth:`arm` at a phase's start, :meth:`disarm` at its end for the largest RSS the helper
    saw in between (0: it saw none, the phase was shorter than one interval or the helper could
    not start; the phase's boundary readings then stand alone)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._shared: Optional[mmap.mmap] = None
        self._helper: Optional[subprocess.Popen] = None
        self._wake: Optional[int] = None  # the pipe's write end: a byte per arm wakes the helper
        self._arming = 0
        self._failed = False
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a fork's child: the helper watches the parent; this process starts its own if asked."""
        if self._wake is not None:
            os.close(self._wake)
        self._shared, self._helper, self._wake, self._failed = None, None, None, False

    def _start(self) -> bool:
        if self._failed:
            return False
        if self._helper is not None and self._helper.poll() is None:
            return True
        try:
            fd = os.memfd_create("fitrl-peak-rss")
            os.ftruncate(fd, 32)
            self._shared = mmap.mmap(fd, 32)
            wake_r, self._wake = os.pipe()
            os.set_blocking(self._wake, False)  # a full pipe (a helper already awake) never blocks a phase
            self._helper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HELPER, str(os.getpid()), str(fd), str(wake_r),
                 str(self.interval_s)],
                pass_fds=(fd, wake_r), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.close(fd)  # the mapping and the helper's copies keep the memory and the pipe
            os.close(wake_r)
            atexit.register(self.close)
            return True
        except (OSError, AttributeError, ValueError):  # no memfd (not Linux), no fork allowed
            log.debug("no peak-RSS sampler: phases read their boundaries only", exc_info=True)
            self._failed = True
            return False

    def arm(self) -> None:
        if not self._start():
            return
        self._arming += 1
        struct.pack_into("<Q", self._shared, 0, self._arming)
        struct.pack_into("<Q", self._shared, 24, 1)
        try:
            os.write(self._wake, b"a")
        except BlockingIOError:
            pass  # 64 KiB of wake-ups unread: the helper is sampling, not asleep
        except OSError:  # the helper is gone: boundary readings from here on
            self._failed = True
    def caught_up(self) -> bool:
        """Whether the helper has read the RSS since the latest :meth:`arm`."""
        return self._shared is not None and struct.unpack_from("<Q", self._shared, 16)[0] == self._arming

    def peak_so_far(self) -> int:
        """The largest RSS the helper has seen since the latest :meth:`arm` (0: none yet)."""
        return struct.unpack_from("<Q", self._shared, 8)[0] if self.caught_up() else 0

    def disarm(self) -> int:
        if self._shared is None or self._failed:
            return 0
        struct.pack_into("<Q", self._shared, 24, 0)
        # [16] is read first: once it holds this phase's count, [8] holds a maximum of this phase
        # (the helper writes a phase's first reading before its count, and no later phase exists yet)
        return self.peak_so_far()

    def close(self) -> None:
        """Stop the helper (at exit; it would also stop by itself within 10 ms of this process)."""
        if self._helper is not None and self._helper.poll() is None:
            self._helper.kill()
            self._helper.wait()
        self._helper = None


SAMPLER = PeakSampler()
"""This process's sampler (one helper per process, whichever recorders use it)."""
