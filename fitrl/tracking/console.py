"""``console``: the one-line-per-step summary.

The trainer prints that line itself (its format, ``fitrl/trainer/logging.py``, reads trainer
keys); this entry makes ``console`` a valid ``trainer.loggers`` name, and leaving it out of the
list silences the step lines.
"""

from __future__ import annotations

from fitrl.tracking.base import Tracker, register_tracker


@register_tracker("console")
class ConsoleTracker(Tracker):
    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass
