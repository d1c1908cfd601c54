"""The rungs of ``fitrl doctor``, in the order they run, and what one rung's result says.

A rung is run in a *session*: the child processes that run a run of consecutive rungs of the
same session name (``node``: one process per device, joined in one process group; the others:
one process). Standard library only: the parent process never needs torch for this.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from typing import Optional

from fitrl.core.errors import UserError


class DoctorInputError(UserError):
    """A ``fitrl doctor`` argument that cannot be served here (no GPU where asked, a Ray address
    that does not answer, an unknown rung): one line, exit 2."""

    kind = "doctor"


@dataclass(frozen=True)
class Rung:
    name: str
    title: str
    session: str             # local | node | ray | engine | memory (see the module docstring)
    fn: str                  # "module:function" the child calls with its RankContext
    limit_s: float           # the rung's own time limit (``--timeout-s`` replaces it)
    depends: tuple[str, ...] = ()
    needs_model: bool = False  # reads the tiny model the parent builds once


RUNGS: tuple[Rung, ...] = (
    Rung("devices", "devices and driver visible, a matmul on each", "local", "fitrl.doctor.devices:devices", 60),
    Rung("attention", "attention kernels that run (SDPA backends, flash-attn, varlen)", "local",
         "fitrl.doctor.devices:attention", 60, depends=("devices",)),
    Rung("collective", "all-reduce across the node's devices", "node", "fitrl.doctor.collective:collective", 120,
         depends=("devices",)),
    Rung("fsdp", "FSDP2 shard, gather and one step, with and without CPU offload", "node",
         "fitrl.doctor.training:fsdp", 300, depends=("collective",), needs_model=True),
    Rung("checkpoint", "checkpoint save and resume with offload, then one more step", "node",
         "fitrl.doctor.training:checkpoint", 300, depends=("fsdp",), needs_model=True),
    Rung("ray", "all-reduce across the Ray cluster's nodes (--ray-address)", "ray", "fitrl.doctor.collective:ray_nodes",
         240, depends=("collective",)),
    Rung("engine", "rollout engine: generate, sleep, wake, weight push, log-probs agree", "engine",
         "fitrl.doctor.engine:engine", 600, depends=("devices",), needs_model=True),
    Rung("memory", "memory plan against measured memory per phase (small shape)", "memory",
         "fitrl.doctor.memory:memory", 300, depends=("devices",), needs_model=True),
)
BY_NAME = {r.name: r for r in RUNGS}
STARTUP_S = 180.0
"""How long a session's processes may take to start and import before their first rung (torch,
transformers; a loaded 2-core machine takes ~10 s): not counted in a rung's own limit."""


def pick(only: list[str], skip: list[str]) -> list[Rung]:
    """The rungs ``--only`` and ``--skip`` leave, in ladder order; an unknown name is a
    :class:`DoctorInputError` naming the nearest and every valid one."""
    for flag, names in (("--only", only), ("--skip", skip)):
        for name in names:
            if name not in BY_NAME:
                near = difflib.get_close_matches(name, list(BY_NAME), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise DoctorInputError(f"{flag} {name}: no such rung{hint}; the rungs are {', '.join(BY_NAME)}")
    return [r for r in RUNGS if (not only or r.name in only) and r.name not in skip]


@dataclass
class Result:
    rung: str
    status: str              # pass | fail | skip
    detail: str              # pass: what was checked and measured; fail: the cause; skip: the reason
    fix: str = ""            # fail: what to do about it
    seconds: float = 0.0
    data: dict = field(default_factory=dict)  # figures for the JSON report

    def line(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix and self.status == "fail" else ""
        took = f" ({self.seconds:.1f} s)" if self.status != "skip" else ""
        return f"{self.status.upper():4}  {self.rung:<10}  {self.detail}{fix}{took}"

    def as_dict(self) -> dict:
        return asdict(self)


def skipped_for(rung: Rung, results: dict[str, Result]) -> Optional[Result]:
    """A skip when one of ``rung``'s prerequisites ran and did not pass (a prerequisite left out
    by ``--only``/``--skip`` does not stop it: each rung builds what it needs itself)."""
    for dep in rung.depends:
        got = results.get(dep)
        if got is not None and got.status != "pass":
            why = "failed" if got.status == "fail" else "was skipped"
            return Result(rung.name, "skip", f"needs {dep}, which {why}")
    return None


@dataclass
class Passed:
    """What a rung returns when it passes: one line of what it checked, and its figures."""

    detail: str
    data: dict = field(default_factory=dict)


def merge(rung: str, per_rank: list[Result]) -> Result:
    """One result from every rank's: the first failure (naming its rank), else rank 0's."""
    for rank, r in enumerate(per_rank):
        if r.status == "fail":
            prefix = f"rank {rank}: " if len(per_rank) > 1 else ""
            return Result(rung, "fail", prefix + r.detail, r.fix, max(x.seconds for x in per_rank), r.data)
    return per_rank[0]


class Skip(Exception):
    """Raised by a rung: it cannot run here; the message is the reason."""


class Failure(Exception):
    """Raised by a rung: it ran and found a fault; ``cause`` and ``fix`` become its line."""

    def __init__(self, cause: str, fix: str = "", data: Optional[dict] = None):
        super().__init__(cause)
        self.cause, self.fix, self.data = cause, fix, data or {}


# Causes seen in the field, matched by a piece of the error's text, and what to do about each.
KNOWN_FIXES = (
    ("No backend type associated with device type cpu",
     "a process group created with backend 'nccl' met a host tensor (CPU offload): GPU groups need "
     "'cpu:gloo,cuda:nccl' (fitrl.distributed.process_group.default_backend); update fitrl"),
    ("Expected all tensors to be on the same device",
     "optimizer state or a buffer was left on another device than its parameter (a resume or restart with "
     "offload): update fitrl; FITRL_DEBUG=1 checks the states before every update"),
    ("CUDA driver version is insufficient",
     "the NVIDIA driver is older than this torch build's CUDA: update the driver, or install the torch wheel "
     "for the driver's CUDA version (nvidia-smi shows it)"),
    ("out of memory", "another process holds this device's memory (nvidia-smi), or the shape is too large for it"),
    ("NCCL", "rerun with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see which transport fails; check "
     "NCCL_SOCKET_IFNAME and that the GPUs see each other (nvidia-smi topo -m)"),
    ("Address already in use", "another process took the rendezvous port between the probe and the bind: rerun"),
)


def known_fix(text: str) -> str:
    return next((fix for needle, fix in KNOWN_FIXES if needle in text), "")
