"""Reading a run directory into :class:`RunData`: the only part of the report that touches files.

A run directory (``fitrl/trainer/run.py``) holds ``metrics.jsonl`` (one JSON object per training
step, per validation, and per event such as a leak warning or a guard stop), ``config.yaml`` (the
resolved config), ``plan.json`` (the memory plan's predictions, when the plan ran),
``generations.jsonl`` (sampled generations, when the run logs them) and ``checkpoints/``.

Everything is read as it is at this moment, so the page can be made while the run is still
writing or after it died: a last line without its newline is being written (or was cut by a
kill) and is left out, and so is any other line that is not a JSON object (counted in the notes).
No plotly here and no torch: this module is the part tested on hand-made directories.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from fitrl.checkpoint.layout import CHECKPOINTS, list_complete
from fitrl.core.errors import UserError

METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
PLAN = "plan.json"  # fitrl.trainer.preflight.PLAN_FILE (not imported: that module imports torch)
GENERATIONS = "generations.jsonl"
SAMPLES_TAIL_BYTES = 4 * 1024**2
"""How much of the end of ``generations.jsonl`` is read for the last samples: the file grows all
run long, the page shows a few dozen."""


class ReportError(UserError):
    """The directory cannot make a report (not a run directory, no records yet, plotly missing)."""

    kind = "report"


@dataclass
class Jsonl:
    records: list[dict]
    bad_lines: int = 0          # complete lines that are not JSON objects
    partial_last: bool = False  # the last line had no newline yet


def read_jsonl(path: Path, tail_bytes: Optional[int] = None) -> Jsonl:
    """The JSON objects of a jsonl file, one per complete line. With ``tail_bytes``, only the
    file's last bytes are read and the first (cut) line of them is dropped."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        start = max(0, size - tail_bytes) if tail_bytes else 0
        f.seek(start)
        data = f.read()
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]
    partial = bool(lines) and lines[-1] != b""
    lines = lines[:-1]  # after the last newline: "" or a line still being written
    out = Jsonl([], partial_last=partial)
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            out.bad_lines += 1
            continue
        if isinstance(record, dict):
            out.records.append(record)
        else:
            out.bad_lines += 1
    return out


def _numbers(record: dict) -> dict[str, float]:
    """The record's numeric values (``null`` is how a non-finite value is written: left out)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclass
class PlanPredictions:
    """The memory plan's predicted peaks (``plan.json``) looked up by the run's own process and
    phase labels.

    The plan names process *kinds* (``trainer``, ``driver``, ``rank0``: rank 0's extra load and
    save copies, ``engine``, ``node``) and its own phase names; the run names processes ``rank0``
    (the in-process backend: driver and rank 0 of every role in one process), ``driver`` and
    ``<role>.rank<i>`` (Ray). A Ray reference or critic rank is the plan's ``ref`` or ``critic``
    kind (their processes of their own), the critic's ``values`` and ``critic_update`` phases the
    plan's ``old_logprob`` and ``update``; a plan without those kinds (written before they were
    planned apart) has no prediction for them.
    """

    record: dict

    PHASE_NAMES = {"ref": "ref_logprob"}  # the run's phase -> the plan's, where they differ
    CRITIC_PHASES = {"values": "old_logprob", "critic_update": "update"}  # a critic rank's phases -> the plan's

    def kinds(self, process: str) -> list[str]:
        if process == "driver":
            return ["driver"]
        m = re.fullmatch(r"(?:(\w+)\.)?rank(\d+)", process)
        if m and m.group(1) in ROLES_OF_THEIR_OWN:
            return [m.group(1)]
        if not m or m.group(1) not in (None, "policy"):
            return []
        kinds = ["trainer"] + (["rank0"] if m.group(2) == "0" else [])
        return kinds + (["driver"] if m.group(1) is None else [])

    def peak(self, process: str, phase: str, resource: str, at: str = "expected") -> Optional[float]:
        """Predicted peak in GiB of ``resource`` (``host`` or ``gpu``) for this process and phase;
        None where the plan has no prediction for it. ``at="expected"``: the plan at the expected
        lengths, what a run's typical step should measure (the caps' where the plan has none: the
        caps are the expected lengths, or the plan was written before plan.json kept both);
        ``at="caps"``: the plan at the length caps."""
        if process.startswith("critic."):
            phase = self.CRITIC_PHASES.get(phase, phase)
        phase = self.PHASE_NAMES.get(phase, phase)
        processes = (at == "expected" and self.record.get("expected_processes")) or self.record.get("processes", {})
        found, total = False, 0.0
        for kind in self.kinds(process):
            entry = processes.get(kind, {}).get("phases", {}).get(phase)
            if entry is not None:
                found, total = True, total + float(entry.get(f"{resource}_gib", 0.0))
        if not found or (resource == "gpu" and total == 0.0):
            return None
        return total


ROLES_OF_THEIR_OWN = ("ref", "teacher", "critic", "reward_model", "judge", "rollout")
"""Roles whose Ray ranks are processes of their own: the plan's kind of the same name
(fitrl/memory/roles.py, ``own_process``; tests/test_report.py checks the two agree)."""


@dataclass
class RunData:
    run_dir: Path
    steps: dict[int, dict[str, float]]          # training steps: step -> metrics (the last record of a step wins)
    validation: dict[int, dict[str, float]]     # step -> val/* metrics
    events: list[dict]                          # leak warnings, guard stops, anything with an "event" key
    config: dict = field(default_factory=dict)  # config.yaml parsed ({} when missing or unreadable)
    config_text: Optional[str] = None
    plan: Optional[PlanPredictions] = None
    samples: list[dict] = field(default_factory=list)  # the last generations, oldest first
    checkpoints: list[int] = field(default_factory=list)  # steps with a complete checkpoint
    notes: list[str] = field(default_factory=list)       # what was skipped or missing, for the page
    metrics_mtime: float = 0.0
    partial_last: bool = False

    @property
    def max_steps(self) -> Optional[int]:
        value = self.config.get("trainer", {}).get("max_steps") if isinstance(self.config.get("trainer"), dict) else None
        return value if isinstance(value, int) else None

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)

    def step_keys(self) -> list[str]:
        """Every training-step key, in the order first seen."""
        return list(dict.fromkeys(k for m in self.steps.values() for k in m))

    def val_keys(self) -> list[str]:
        return list(dict.fromkeys(k for m in self.validation.values() for k in m))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key``: from the validation records for ``val/*``, else the steps."""
        source = self.validation if key.startswith("val/") else self.steps
        points = [(s, m[key]) for s, m in sorted(source.items()) if key in m]
        return [s for s, _ in points], [v for _, v in points]

    def guard_stops(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "memory_guard_stop"]

    def hangs(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "hang"]

    def restarts(self) -> list[dict]:
        """``trainer.max_restarts`` at work: each at the checkpoint step the run resumed from."""
        return [e for e in self.events if e.get("event") == "restart"]

    def leak_warnings(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "memory_leak"]

    def status(self) -> str:
        """Where the run stands, in one sentence."""
        stops = self.guard_stops()
        ckpt = f"newest complete checkpoint: step {self.checkpoints[-1]}" if self.checkpoints else "no complete checkpoint"
        if stops:
            s = stops[-1]
            where = ", ".join(f"{k} {s[k]}" for k in ("kind", "phase", "process") if s.get(k))
            return f"stopped by the memory guard at step {s.get('step')} ({where}); {ckpt}"
        if self.hangs():
            h = self.hangs()[-1]
            return (f"stopped by the hang watchdog at step {h.get('step')} (phase {h.get('phase')}, no progress for "
                    f"{h.get('limit_s')} s; the stacks are in hang.txt); {ckpt}")
        n = len(self.restarts())
        restarted = f" after {n} restart{'s' if n > 1 else ''} (trainer.max_restarts)" if n else ""
        if self.max_steps is not None and self.last_step >= self.max_steps:
            return f"finished: {self.last_step} of {self.max_steps} steps{restarted}; {ckpt}"
        ago = _ago(time.time() - self.metrics_mtime)
        of = f" of {self.max_steps}" if self.max_steps is not None else ""
        return (f"at step {self.last_step}{of}{restarted}: still running, or stopped early (metrics.jsonl last written "
                f"{ago} ago); {ckpt}")


def _ago(seconds: float) -> str:
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def load_run(run_dir: Path | str, samples: int = 20) -> RunData:
    """Read ``run_dir``; raises :class:`ReportError` when it is not a run directory or holds no record yet."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such directory (give a run directory, e.g. runs/arith-grpo-...)")
    metrics_path = run_dir / METRICS
    if not metrics_path.is_file():
        raise ReportError(f"{run_dir} is not a run directory: it has no {METRICS} (fitrl train writes one per run)")
    metrics = read_jsonl(metrics_path)
    data = RunData(run_dir=run_dir, steps={}, validation={}, events=[], metrics_mtime=metrics_path.stat().st_mtime,
                   partial_last=metrics.partial_last)
    for record in metrics.records:
        step = record.get("step")
        if not isinstance(step, int):
            data.notes.append(f"{METRICS}: a record without an integer step was skipped")
            continue
        if "event" in record:
            data.events.append(record)
            continue
        numbers = _numbers(record)
        val = {k: v for k, v in numbers.items() if k.startswith("val/")}
        train = {k: v for k, v in numbers.items() if not k.startswith("val/")}
        if val:  # validation records; a step record repeats its step's validation, same values
            data.validation.setdefault(step, {}).update(val)
        if train:
            data.steps[step] = train  # a resumed run may re-record a step: the later record is the run's
    if not data.steps and not data.validation:
        raise ReportError(f"{metrics_path} holds no complete record yet (the run has not finished a step or a "
                          "validation): try again later")
    if metrics.partial_last:
        data.notes.append(f"the last line of {METRICS} is incomplete (the run is writing it, or was killed while "
                          "writing): left out")
    if metrics.bad_lines:
        data.notes.append(f"{metrics.bad_lines} line(s) of {METRICS} are not JSON objects: left out")
    _read_config(data)
    _read_plan(data)
    _read_samples(data, samples)
    if (run_dir / CHECKPOINTS).is_dir():
        data.checkpoints = [c.step for c in list_complete(run_dir / CHECKPOINTS)]
    return data


def _read_config(data: RunData) -> None:
    path = data.run_dir / CONFIG
    if not path.is_file():
        data.notes.append(f"no {CONFIG} in the run directory: the resolved config is not shown")
        return
    data.config_text = path.read_text(errors="replace")
    try:
        parsed = yaml.safe_load(data.config_text)
    except yaml.YAMLError as e:
        data.notes.append(f"{CONFIG} could not be parsed ({type(e).__name__}): shown as text only")
        return
    data.config = parsed if isinstance(parsed, dict) else {}


def _read_plan(data: RunData) -> None:
    path = data.run_dir / PLAN
    if not path.is_file():
        data.notes.append(f"no {PLAN}: the memory plan did not run (memory.plan=off, or a run from before "
                          "plans were saved), so no predicted peaks are drawn")
        return
    try:
        record = json.loads(path.read_text())
    except ValueError:
        data.notes.append(f"{PLAN} is not valid JSON: no predicted peaks are drawn")
        return
    data.plan = PlanPredictions(record if isinstance(record, dict) else {})


def _read_samples(data: RunData, limit: int) -> None:
    path = data.run_dir / GENERATIONS
    if limit <= 0 or not path.is_file():
        return
    read = read_jsonl(path, tail_bytes=SAMPLES_TAIL_BYTES)
    data.samples = read.records[-limit:]
