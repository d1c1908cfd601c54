"""Exceptions that end a run with one clear line instead of a traceback.

Import-light on purpose (standard library only): the CLI catches these before anything heavy
loads. Which exit status each one gets is decided in :mod:`fitrl.cli`:

- :class:`UserError` and every subclass: a mistake the user can fix, in the config, the data, the
  model directory, the reward file, the run directory, the checkpoint they named or the Ray
  cluster they asked for (exit 2). The CLI catches the base class once, so a new kind of user
  error is a subclass, not a new except;
- :class:`RunStopped` and its :class:`CheckpointError`: the run cannot go on as configured (exit 1);
- :class:`WorkerFailed`: a worker process died (exit 1), naming role, rank, node, phase and cause.
- :class:`Interrupted`: SIGINT or SIGTERM (exit 130 or 143).

Anything else reaching the CLI is a bug in fitrl: it prints its traceback and says so (exit 1).
"""

from __future__ import annotations

from typing import Optional


class UserError(Exception):
    """A mistake the user can fix; the CLI prints ``fitrl: <kind>: <message>`` as one line and
    exits 2, with no traceback (``--debug`` or ``FITRL_DEBUG=1`` shows it). The message names
    the file, key or row and says what to change."""

    kind = "error"


class ConfigError(UserError, ValueError):
    """A configuration problem a user can fix; the CLI prints it as one line and exits 2."""

    kind = "config error"


class ModelDirError(ConfigError):
    """A model directory (``*.model.path``, ``*.model.tokenizer_path``) that cannot serve the run:
    unreadable ``config.json``, missing or corrupt weights, an empty or mismatched tokenizer."""

    kind = "model error"


class DataError(UserError, ValueError):
    """A problem in the data files or data options that the user can fix; names where it is."""

    kind = "data error"


class RunDirError(UserError):
    """The run directory cannot be created or written, or another run holds its lock."""

    kind = "run directory"


class ClusterError(UserError):
    """The Ray cluster cannot serve the run as asked: its address does not answer, or it has not
    (and, within ``trainer.placement_timeout_s``, did not come to have) the nodes, CPUs or GPUs
    the worker groups ask for. The message names what was asked and what the cluster has."""

    kind = "ray cluster"


class RunStopped(RuntimeError):
    """The run cannot continue as configured; the message says why and what to change."""


class CheckpointError(RunStopped):
    """A checkpoint that is missing, incomplete, corrupt or does not fit this run; the message
    names the file and what is wrong."""


class CheckpointUsageError(CheckpointError, UserError):
    """A checkpoint named or used by mistake (it does not exist, it does not fit this run's
    settings, an export's output directory is not empty): a user error (exit 2), where damage
    to a checkpoint stays a :class:`CheckpointError` (exit 1)."""

    kind = "checkpoint error"


class EngineError(RunStopped):
    """The rollout engine cannot serve the run: it could not be built on this machine, or a weight
    push failed part-way and left it holding half-loaded weights. The trainer's state and its last
    checkpoint are intact; the message says what happened and what to change (exit 1)."""


class EngineBroken(EngineError):
    """A rollout engine that worked broke mid-run (a weight push failed part-way, the engine or
    one of its processes died during a call): rebuilding it serves again, so with
    ``trainer.max_restarts`` the run restarts from its newest checkpoint (fitrl/trainer/run.py);
    an engine that could not be built at all stays an :class:`EngineError`."""


class Diverged(RunStopped):
    """The training has diverged (non-finite loss, gradient, weights or logits; a saturated or
    collapsed policy; KL or reward out of bounds): the run stops without saving the diverged
    weights, and the message says which signal fired and what to change (exit 1)."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM ended the run (fitrl.trainer.signals): at a safe point, with or without
    an emergency checkpoint as the message says, or at once on a second signal.

    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` on the way may
    swallow it, while ``finally`` blocks and context managers still clean up (worker groups,
    reward processes, a half-written checkpoint's temporary directory). The CLI exits with
    ``exit_status``: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell
    reports a process that the signal killed.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


class Hung(BaseException):
    """A phase made no progress for its limit (``trainer.hang_timeout_s``; fitrl/trainer/watchdog.py).

    Raised in the main thread by the watchdog's thread; a ``BaseException`` so that no
    ``except Exception`` on the way swallows it. The message names the phase, the stuck ranks and
    the checkpoint a next run continues from; the stacks were printed before it (exit 1)."""


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
