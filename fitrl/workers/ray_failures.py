"""What went wrong on a rank of a Ray worker group, in words the driver can print.

A Python exception raised on a rank comes back (:func:`with_prefix`) with its original type and
a prefix naming role, rank, node and method; a dead actor is recognised (:func:`is_death`) and
explained (:func:`describe_death`): killed by Ray's memory monitor, node lost, ``ray.kill``,
unreachable, or crashed without a Python exception. See docs/architecture.md, "Failure stories".
"""

from __future__ import annotations

import copy
import re

from fitrl.telemetry.guard import MemoryPressure

# ray.exceptions is imported inside the functions: importing this module needs no ray.

# Ray's wording for a worker killed by its memory monitor (the "OOM killer" in a crash message is
# only one of the possible causes it lists, so it must not match).
_OOM_RE = re.compile(r"NODE_OUT_OF_MEMORY|running low on memory|killed due to memory pressure", re.I)
_EXIT_RE = re.compile(r"Worker exit type: (\S+) Worker exit detail: (.*?)(?: Some common causes|\n|$)")
_MEM_RE = re.compile(r"was ([\d.]+\s*\w*B used / [\d.]+\s*\w*B limit)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def is_death(exc: BaseException) -> bool:
    """Did this error from ``ray.get`` mean the actor's process is gone?"""
    import ray.exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.OutOfMemoryError, rex.WorkerCrashedError,
                            rex.NodeDiedError, rex.LocalRayletDiedError))


def describe_death(exc: BaseException, node_ip: str = "?") -> tuple[str, str]:
    """``(kind, cause)`` for an actor death reported by Ray; kind is ``oom``, ``node_died``,
    ``killed``, ``unavailable`` or ``crashed``."""
    import ray.exceptions as rex

    text = ANSI_RE.sub("", str(exc))
    if isinstance(exc, rex.OutOfMemoryError) or _OOM_RE.search(text):
        mem = _MEM_RE.search(text)
        return "oom", "killed by the memory monitor (host OOM)" + (f": node memory {mem.group(1)}" if mem else "")
    if isinstance(exc, (rex.NodeDiedError, rex.LocalRayletDiedError)) or getattr(exc, "preempted", False) \
            or re.search(r"NODE_DIED|node (?:\S+ )?(?:has )?died", text, re.I):
        return "node_died", "its node died or was preempted"
    if "ray.kill" in text:
        return "killed", "killed by ray.kill"
    if isinstance(exc, rex.ActorUnavailableError):
        return "unavailable", "unreachable (network trouble or an overloaded node)"
    m = _EXIT_RE.search(text)
    how = f" ({m.group(1)}: {m.group(2).strip()})" if m else ""
    return "crashed", (f"crashed{how} - the process ended without a Python exception: a segfault, os._exit, "
                       f"or the kernel OOM killer (check `dmesg` on {node_ip})")


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank, chained under the re-raised one."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def with_prefix(exc: BaseException, prefix: str) -> BaseException:
    """A copy of ``exc`` (same type) whose message starts with ``prefix``."""
    try:
        new = copy.copy(exc)
        if isinstance(new, OSError) and new.strerror:  # str() reads errno/strerror, not args
            new.strerror = prefix + new.strerror
        elif exc.args and isinstance(exc.args[0], str):
            new.args = (prefix + exc.args[0], *exc.args[1:])
        else:
            new = type(exc)(prefix + str(exc))
        if prefix in str(new):
            return new
    except Exception:  # a type that will not copy or rebuild: keep its text, lose its type
        pass
    return RuntimeError(f"{prefix}{type(exc).__name__}: {exc}")


def is_memory_pressure(exc: BaseException) -> bool:
    """Is this (possibly a ``RayTaskError`` wrapping it) the memory guard's stop?"""
    return isinstance(getattr(exc, "cause", None) or exc, MemoryPressure)

