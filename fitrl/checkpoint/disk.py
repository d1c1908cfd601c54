"""Is a failed checkpoint save the storage's fault (a full disk, a quota, a read-only mount)?

A save that runs out of room does not always say so: torch's zip writer (``torch.save``, and
through it each shard torch.distributed.checkpoint writes) loses the OS's ``ENOSPC`` and raises
``RuntimeError: ... unexpected pos 704 vs 598``, which DCP wraps in a ``CheckpointException``
(a ``BaseException``) listing each rank's failure; under Ray the driver gets a copy of the rank's
error (fitrl/workers/ray_failures.py). So besides the errno anywhere in the error's chain, a
failure is read as a full disk when the directory's filesystem has almost no room left at that
moment (measured before the partial save is removed: its files are what filled it). Measured on
a 3.5 MB tmpfs holding one 2.2 MiB checkpoint: the second save failed with that RuntimeError and
left 12 KiB free.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator, Optional

STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "a read-only file system", errno.EIO: "an input/output error"}
LOW_FREE_BYTES = 64 * 2**20
"""Free bytes under which any failure of a save is read as the disk being full: a writer that
ran out of room leaves a few blocks at most (it writes until the device refuses), and a
checkpoint needs far more than this."""
STORAGE_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT}
"""The OS's words for those errors, where a writer kept only its text."""
WRITE_FAILED_TEXT = ("unexpected pos", "file write failed")
"""What torch's zip writer (``PyTorchStreamWriter``) says when a write was refused."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures a ``CheckpointException`` holds."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # {rank: (exception, traceback summary)}
        if isinstance(failures, dict):
            todo += [x for v in failures.values() for x in (v if isinstance(v, tuple) else (v,))
                     if isinstance(x, BaseException)]


def free_bytes(directory: Path) -> Optional[int]:
    """Bytes an unprivileged writer may still use on ``directory``'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def storage_failure(error: BaseException, directory: Path) -> Optional[str]:
    """What the storage did, in a few words (``no space left on device (12 KiB free)``), when
    ``error``, raised while writing into ``directory``, is its fault; None otherwise."""
    free = free_bytes(directory)
    # (ENOSPC with room for blocks: the filesystem is out of inodes, or a quota said so)
    free_text = "" if free is None else f" ({_size(free)} free)" if free < LOW_FREE_BYTES else " (out of inodes?)"
    errors = list(_chain(error))
    for e in errors:
        code = e.errno if isinstance(e, OSError) else next((c for t, c in STORAGE_TEXT.items() if t in str(e)), None)
        if code in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[code] + (free_text if code == errno.ENOSPC else "")
    if free is not None and free < LOW_FREE_BYTES:
        return "no space left on device" + free_text
    if any(t in str(e) for e in errors for t in WRITE_FAILED_TEXT):
        return f"a write the storage refused (torch's writer: {_first_line(errors, WRITE_FAILED_TEXT)}; a quota?)"
    return None


def _first_line(errors: list[BaseException], texts: tuple[str, ...]) -> str:
    """The first line of ``errors``' messages that holds one of ``texts``."""
    return next(line.strip() for e in errors for line in str(e).splitlines() if any(t in line for t in texts))


def _size(n: int) -> str:
    """``n`` bytes for people: 12 KiB, 3.4 MiB, 2.0 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n // 1024} KiB"
