"""What the user sees: one compact console line per step, metrics.jsonl, a progress bar."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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


def make_progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, disable=not (enabled and console.is_terminal), transient=False,
    )
