"""What the user sees: one compact console line per step, metrics.jsonl, a progress bar (on a
terminal; elsewhere, a log file or a pipe, a plain progress line with the ETA every minute)."""

from __future__ import annotations

import datetime
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

CONSOLE_FIELDS = [  # (metric, label, format)
    ("reward/mean", "reward", "{:.3f}"),
    ("sft/nll", "nll", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("actor/kl_loss", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.2f}"),
    ("actor/clip_frac", "clip", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.2f}"),
]


def format_step_line(step: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>4}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in m:
            parts.append(f"{label} {fmt.format(m[key])}")
    phases = [(k[5:], v) for k, v in m.items() if k.startswith("time/") and k != "time/step"]
    if "time/step" in m:
        parts.append(f"{m['time/step']:.1f}s (" + " ".join(f"{k} {v:.1f}" for k, v in phases) + ")")
    if "perf/tokens_per_s" in m:  # MFU to 3 significant digits: a tiny CPU model's is ~0.01 %
        parts.append(f"{m['perf/tokens_per_s']:,.0f} tok/s"
                     + (f" mfu {100 * m['perf/mfu']:.3g}%" if "perf/mfu" in m else ""))
    if "mem/host_peak_gib" in m:
        where = peak_phase(m, "host_peak_gib")
        mem = f"host peak {m['mem/host_peak_gib']:.2f}G{where} avail {m['mem/node_available_min_gib']:.1f}G"
        if "mem/gpu_peak_gib" in m:
            mem += f" | gpu peak {m['mem/gpu_peak_gib']:.1f}G{peak_phase(m, 'gpu_peak_gib')}"
        parts.append(mem)
    elif "mem/host_rss_gib" in m:
        parts.append(f"rss {m['mem/host_rss_gib']:.2f}G")
    return " | ".join(parts)


def peak_phase(m: dict[str, float], field: str) -> str:
    """`` (update@rank0)``: where the step's largest ``mem/<process>/<phase>/<field>`` was."""
    keys = [k for k in m if k.startswith("mem/") and k.endswith("/" + field) and k.count("/") == 3]
    if not keys:
        return ""
    _, process, phase, _ = max(keys, key=m.__getitem__).split("/")
    return f" ({phase}@{process})"


class MetricsWriter:
    """Appends one JSON object per step (and per validation) to ``metrics.jsonl``."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


PLAIN_PROGRESS_EVERY_S = 60.0
"""How often a console that is not a terminal gets a progress line (and at the last step)."""


class PlainProgress(Progress):
    """The progress bar's counterpart where the console is not a terminal (a log file, a pipe, a
    job scheduler's output, where a live bar cannot redraw): no bar, but a line at most every
    ``every_s`` seconds and at the last step, ``progress: step 12/300 (4%), elapsed 0:02:05, ETA
    0:50:00``. The ETA is the mean time of the steps this process ran (a resumed run's earlier
    steps are not among them) times the steps left."""

    def __init__(self, *columns, every_s: float = PLAIN_PROGRESS_EVERY_S, **kw) -> None:
        super().__init__(*columns, **{**kw, "disable": True})
        self.every_s = every_s
        self._started: dict = {}  # task -> (its clock at add_task, its steps then)
        self._printed = 0.0

    def add_task(self, description: str, **kw):
        task = super().add_task(description, **kw)
        self._started[task] = (self.get_time(), self._task(task).completed)
        self._printed = self.get_time()
        return task

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        t = self._task(task_id)
        now = self.get_time()
        done = t.total is not None and t.completed >= t.total
        if done or now - self._printed >= self.every_s:
            self._printed = now
            self.console.print(progress_line(t.completed, t.total, *self._started[task_id], now), highlight=False,
                               markup=False)


    def _task(self, task_id):
        return next(t for t in self.tasks if t.id == task_id)


def progress_line(step: float, total: Optional[float], started_at: float, started_step: float, now: float) -> str:
    """``progress: step 12/300 (4%), elapsed 0:02:05, ETA 0:50:00`` (no ETA before a step is timed;
    ``done`` at the last).

    >>> progress_line(12, 300, 0.0, 2, 100.0)
    'progress: step 12/300 (4%), elapsed 0:01:40, ETA 0:48:00'
    >>> progress_line(300, 300, 0.0, 0, 3600.0)
    'progress: step 300/300 (100%), elapsed 1:00:00, done'
    """
    elapsed = now - started_at
    text = f"progress: step {step:.0f}"
    if total:
        text += f"/{total:.0f} ({100 * step / total:.0f}%)"
    text += f", elapsed {_clock(elapsed)}"
    ran = step - started_step
    if total and step >= total:
        return text + ", done"
    if total and ran > 0:
        text += f", ETA {_clock(elapsed / ran * (total - step))}"
    return text


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


def make_progress(console: Console, enabled: bool, every_s: float = PLAIN_PROGRESS_EVERY_S,
                  clock: Optional[Callable[[], float]] = None) -> Progress:
    """A bar on a terminal; elsewhere :class:`PlainProgress`'s lines; nothing when not ``enabled``
    (``trainer.progress_bar``). ``clock``: seconds (tests pass their own)."""
    kind = Progress if console.is_terminal or not enabled else PlainProgress
    extra = {"every_s": every_s} if kind is PlainProgress else {}
    return kind(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, disable=not enabled, transient=False, get_time=clock or time.monotonic, **extra,
    )
