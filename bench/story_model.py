"""The failure stories' types (a report's failure, a change, a figure, a story, its planned
outcome) and the plan measures their figures read. ``bench/failure_stories.py`` holds the stories
themselves, plans them and writes docs/failure-stories.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from fitrl.memory.model import DEVICE_KINDS, Plan
from fitrl.memory.states import full_weights

ROOT = Path(__file__).resolve().parent.parent
STORIES_DIR = ROOT / "examples" / "failure_stories"
GIB = 1024**3
ASPECTS = ("fails", "resource", "phase", "step", "fix")


@dataclass(frozen=True)
class Failure:
    """What the report says ran out, in the plan's terms."""
    resource: str                 # "gpu" | "host"
    phases: tuple[str, ...]       # the plan phases that are where the report failed
    step: Optional[int]           # the step it failed at when that depends on the step, else None
    text: str                     # the report's failure, in our words


@dataclass(frozen=True)
class Change:
    """A change planned against the story: dotted overrides of keys a run reads."""
    overrides: tuple[str, ...]
    text: str                     # where it comes from (the report's fix, its advice, ...)


@dataclass(frozen=True)
class Figure:
    """A figure of the report and the plan's figure for the same quantity."""
    what: str
    reported: str
    planned: Callable[["Outcome"], str]


@dataclass(frozen=True)
class Story:
    key: str
    file: str
    title: str
    source: str                   # the seed file and the public thread behind it
    reported: str                 # model, hardware, batch as the report gives them
    failure: Failure
    fix: Change                   # the change the reporter applied (or the one that fits, said why)
    tried: tuple[Change, ...] = ()  # other changes of the report's, planned for comparison
    figures: tuple[Figure, ...] = ()
    gaps: dict[str, str] = field(default_factory=dict)  # aspect -> why the plan differs from the report

    @property
    def path(self) -> Path:
        return STORIES_DIR / self.file


@dataclass
class Outcome:
    story: Story
    plan: Plan
    fixed: Plan
    tried: list[Plan]

    def matches(self) -> dict[str, bool]:
        """Per aspect (:data:`ASPECTS`), whether the plan agrees with the report: it does not fit
        (``fails``), on the report's resource, in one of its phases, at its step (any resource:
        each aspect is judged on its own), and the fix fits."""
        f, problems = self.story.failure, self.plan.problems()
        mine = [p for p in problems if p.resource == f.resource]
        return {"fails": bool(problems),
                "resource": bool(mine),
                "phase": any(p.phase in f.phases for p in problems),
                "step": f.step is None or any(p.step == f.step for p in problems),
                "fix": self.fixed.fits}


def gib(n: float) -> str:
    return f"{n / GIB:,.1f}"


def peak(plan: Plan, resource: str) -> tuple[str, int]:
    """(phase, bytes) of the plan's peak: one device ("gpu") or node 0's host ("host")."""
    i = 0 if resource == "gpu" else 1
    phase, values = max(plan.peaks().items(), key=lambda kv: kv[1][i])
    return phase, values[i]


def per_gpu_at(plan: Plan, phase: str) -> int:
    """Host bytes per GPU in ``phase``: the ranks of every role and the engine workers on a node,
    over its GPUs (what one colocated EasyR1/veRL ``WorkerDict`` process holds); not the driver,
    Ray or rank 0's extra copy."""
    kinds = [p for p in plan.processes if p.kind not in ("driver", "node", "rank0") and phase in p.phases]
    return sum(p.host_peak(phase) * p.per_node for p in kinds) // plan.hardware.gpus_per_node


def checkpoint_copies(plan: Plan) -> float:
    """Full copies of the checkpoint node 0 holds while loading: in its host memory, and on its
    devices (``plan.emulate.load_on_device``: every rank's copy on its own device)."""
    copy = full_weights(plan.shape, plan.cfg.actor.model.dtype)
    on_devices = sum(p.phases["load"].gpu.get("checkpoint copy", 0) * p.per_node for p in plan.processes
                     if p.kind in DEVICE_KINDS and "load" in p.phases)
    return (plan.node_host("load").get("checkpoint copy", 0) + on_devices) / copy


def _peak_text(o: Outcome, resource: str) -> str:
    phase, value = peak(o.plan, resource)
    return f"{gib(value)} GiB ({phase})"
