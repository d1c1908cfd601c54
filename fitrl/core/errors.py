"""Exceptions that end a run with one clear line instead of a traceback.

Import-light on purpose (standard library only): the CLI catches these before anything heavy
loads. Which exit status each one gets is decided in :mod:`fitrl.cli`:

- :class:`ConfigError`, :class:`DataError`: a user's mistake in the config or the data (exit 2);
- :class:`RunStopped` and its :class:`CheckpointError`: the run cannot go on as configured (exit 1);
- :class:`WorkerFailed`: a worker process died (exit 1), naming role, rank, node, phase and cause.
"""

from __future__ import annotations

from typing import Optional


class ConfigError(ValueError):
    """A configuration problem a user can fix; the CLI prints it as one line and exits 2."""


class DataError(ValueError):
    """A problem in the data files or data options that the user can fix; names where it is."""


class RunStopped(RuntimeError):
    """The run cannot continue as configured; the message says why and what to change."""


class CheckpointError(RunStopped):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run; the message
    names the file and what is wrong."""


class WorkerFailed(RuntimeError):
    """A worker process died (crash, memory kill, lost node): the group cannot go on.

    ``str()`` names the role, the rank, its node, the method being run (the phase) and the cause
    as the cluster reported it; the fields carry the same for programs.
    """

    def __init__(self, role: str, rank: int, node_ip: str, phase: str, cause: str, detail: str = "",
                 *, kind: str = "crashed", other_ranks: Optional[dict[int, str]] = None):
        self.role, self.rank, self.node_ip, self.phase = role, rank, node_ip, phase
        self.cause, self.detail, self.kind = cause, detail, kind
        self.other_ranks = dict(other_ranks or {})
        msg = f"{role} rank {rank} on node {node_ip} died during {phase!r}: {cause}"
        if self.other_ranks:
            msg += "; also " + ", ".join(f"rank {r}: {c}" for r, c in sorted(self.other_ranks.items()))
        if detail:
            msg += "\n" + "\n".join("    " + line for line in detail.strip().splitlines())
        super().__init__(msg)

    def __reduce__(self):  # picklable across processes despite the keyword-only fields
        return (_rebuild_worker_failed, (self.role, self.rank, self.node_ip, self.phase, self.cause,
                                         self.detail, self.kind, self.other_ranks))


def _rebuild_worker_failed(role, rank, node_ip, phase, cause, detail, kind, other_ranks) -> WorkerFailed:
    return WorkerFailed(role, rank, node_ip, phase, cause, detail, kind=kind, other_ranks=other_ranks)
