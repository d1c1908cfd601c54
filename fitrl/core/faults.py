"""Injected faults, for the tests and benchmarks of hangs and dead workers
(tests/test_watchdog.py, bench/restart_soak.py).

``FITRL_INJECT_FAULT=<role>:<rank>:<phase>:<n>:<hang|kill>`` acts at that process's n-th fault
point of that phase: ``hang`` never returns (as a rank stuck in user code would), ``kill``
SIGKILLs the process (as the kernel's OOM killer or a lost node would). ``<n>`` written
``p0.05``: at each point, with that probability. Points are counted per process.

The fault points: every Ray rank's call, named by the driver's phase (fitrl/workers/ray_actor.py).
A process says which role and rank it is with :func:`identify` (one that never does is policy
rank 0).

``FITRL_INJECT_OWN_DISK=<role>:<rank>:<what>:<dir>`` gives that rank a disk of its own: the
paths it writes or reads for ``<what>`` (``checkpoint``: its shards, ``run_dir``: the start-up
check of the run directory, ``all``: both; ``model``: the model and tokenizer directories it
checks before loading, fitrl/models/loading.py) lie under ``<dir>`` instead, as on a node whose
``trainer.run_dir`` is a local directory of the same name (tests/test_checkpoint_nodes.py), or
that lacks the model directory the driver has (tests/test_ray_placement.py).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

INJECT_FAULT = "FITRL_INJECT_FAULT"
INJECT_OWN_DISK = "FITRL_INJECT_OWN_DISK"
_CALLS: dict[str, int] = {}
_WHO = {"role": "policy", "rank": 0}
_ALL = {"checkpoint": "all", "run_dir": "all"}  # what ``all`` stands for (not ``model``)


def identify(role: str, rank: int) -> None:
    """This process is ``role``'s rank ``rank`` (Ray ranks, at start-up)."""
    _WHO.update(role=role, rank=rank)


def fault_point(phase: str) -> None:
    """Act on ``FITRL_INJECT_FAULT`` if it names this process and ``phase``; nothing otherwise."""
    spec = os.environ.get(INJECT_FAULT)
    if not spec:
        return
    want_role, want_rank, want_phase, nth, fault = spec.split(":")
    if (_WHO["role"], str(_WHO["rank"]), phase) != (want_role, want_rank, want_phase):
        return
    _CALLS[phase] = _CALLS.get(phase, 0) + 1
    if nth.startswith("p"):
        if random.Random().random() >= float(nth[1:]):  # (its own stream: the run's RNGs stay untouched)
            return
    elif _CALLS[phase] != int(nth):
        return
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # a hang: no heartbeat from here on
        time.sleep(0.1)


def own_disk(path: str | Path, what: str) -> Path:
    """``path`` as this rank sees it: the same path, unless ``FITRL_INJECT_OWN_DISK`` names this
    process and ``what``; then the same path under that variable's directory."""
    path = Path(path)
    spec = os.environ.get(INJECT_OWN_DISK)
    if not spec:
        return path
    want_role, want_rank, want_what, root = spec.split(":", 3)
    if (_WHO["role"], str(_WHO["rank"])) != (want_role, want_rank) or want_what not in (what, _ALL.get(what)):
        return path
    return Path(root) / path.absolute().relative_to("/")
