"""The tracker interface, its registry, and what every tracker is opened with.

A tracker receives what ``metrics.jsonl`` receives (numbers per step), tables of generation
samples, and the resolved config once. Its library is imported when the tracker opens, never
when fitrl is imported: the base install does not carry TensorBoard, W&B or MLflow.
"""

from __future__ import annotations

import importlib.util
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from fitrl.core.errors import ConfigError
from fitrl.core.registry import Registry

TRACKERS: Registry = Registry("tracker", "trainer.loggers")

INSTALL_HINT = "pip install 'fitrl[trackers]'"


def register_tracker(name: str):
    """``@register_tracker("wandb")`` over a :class:`Tracker` class: registered in :data:`TRACKERS`
    under ``name``, which is also its ``name`` (what warnings and ``trackers.json`` call it)."""
    def wrap(cls: type["Tracker"]) -> type["Tracker"]:
        cls.name = name
        return TRACKERS.register(name)(cls)
    return wrap


@dataclass
class TrackerRun:
    """What a tracker is opened with (plain values: this package does not read the config)."""

    run_dir: Path
    """The fitrl run directory: local tracker files go under it."""
    project: str
    """W&B project / MLflow experiment."""
    name: str
    """The tracker run's display name."""
    resume_step: int = 0
    """> 0: the run continues after this checkpointed step."""
    resume_id: Optional[str] = None
    """The tracker's own run id saved by the run being resumed (``trackers.json``)."""
    appends: bool = False
    """The run only adds to what an earlier run in this directory logged (``trainer.val_only``):
    nothing of it is replaced or hidden."""
    wandb_mode: Optional[str] = None
    """``online``/``offline``; None: decided from the environment (see the wandb tracker)."""
    mlflow_tracking_uri: Optional[str] = None
    """None: ``MLFLOW_TRACKING_URI``, else a SQLite database in the run directory."""


class Tracker(ABC):
    """One experiment tracker. Methods may raise: the caller turns a failure into one warning
    and drops the tracker, so a full disk or a dead server never stops training."""

    name: ClassVar[str]
    """The ``trainer.loggers`` name (set by :func:`register_tracker`)."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Modules that must be importable; missing ones stop the run before any model loads."""

    run_id: Optional[str] = None
    """The tracker's own run id, saved in the run directory so a resumed run continues it."""

    def __init__(self, run: TrackerRun):
        self.run = run

    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Scalars of one step (finite numbers only)."""

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        """A table (rows share their keys); trackers without tables ignore it."""

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved config, as run config / hyper-parameters."""

    def close(self) -> None:
        """Flush and end the tracker run."""


def missing_modules(tracker: type[Tracker]) -> list[str]:
    return [m for m in tracker.requires if importlib.util.find_spec(m) is None]


def check_installed(names: list[str]) -> None:
    """Raise one :class:`ConfigError` line naming the extra to install when a configured
    tracker's package is missing (cheap: nothing is imported)."""
    for name in names:
        missing = missing_modules(TRACKERS.get(name))
        if missing:
            raise ConfigError(f"trainer.loggers names {name!r}, which needs {', '.join(missing)} "
                              f"(not installed): {INSTALL_HINT}")


def finite_numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numeric values, ``step`` left out (events and text are not metrics)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def table_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of ``rows`` in first-seen order."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return list(columns)


def cell_text(value: Any) -> Any:
    """Numbers stay numbers; anything else (answers may be lists or dicts) becomes text, so a
    column has one type for trackers that type their columns."""
    if value is None or isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return value
    return str(value)
