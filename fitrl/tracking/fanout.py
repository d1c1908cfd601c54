"""Every configured tracker behind one object: opened once, fed together, and dropped one by
one when they fail, so a tracker's failure (a full disk, a dead server, a library bug) costs its
own logging and never the training run.

The trackers' own run ids are kept in ``<run_dir>/trackers.json``; a run that resumes from a
checkpoint reopens those runs instead of starting new ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Optional

from fitrl.core.errors import ConfigError
from fitrl.tracking.base import TRACKERS, Tracker, TrackerRun, check_installed

IDS_FILE = "trackers.json"

log = logging.getLogger("fitrl.tracking")


class Trackers:
    def __init__(self, names: list[str], run: TrackerRun, warn: Optional[Callable[[str], None]] = None):
        # the console entry prints nothing here (the trainer prints the step line)
        self.names = [n for n in dict.fromkeys(names) if n != "console"]
        self.run = run
        self.warn = warn or log.warning
        self.active: list[Tracker] = []

    def open(self, config: dict[str, Any]) -> None:
        """Open each tracker (resuming its saved run when ``run.resume_step`` > 0) and log the
        config. A missing package is a :class:`ConfigError`; any other failure a warning."""
        check_installed(self.names)
        saved = self._saved_ids() if self.run.resume_step else {}
        for name in self.names:
            run = dataclasses.replace(self.run, resume_id=saved.get(name))
            try:
                tracker = TRACKERS.get(name)(run)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 -- any library error: go on without this tracker
                self.warn(f"tracker {name}: could not start ({type(e).__name__}: {e}); training goes on "
                          "without it (metrics.jsonl has every metric)")
                continue
            self.active.append(tracker)
        self._save_ids()
        self._each("log the config", lambda t: t.log_config(config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if metrics:
            self._each("log metrics", lambda t: t.log(step, metrics))

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._each("log a table", lambda t: t.log_table(step, name, rows))

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        self.active = []

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 -- warn once, drop the tracker, keep training
                self.active.remove(tracker)
                self.warn(f"tracker {tracker.name}: {what} failed ({type(e).__name__}: {e}); it is off for the "
                          "rest of the run (metrics.jsonl and generations.jsonl have everything)")
                if what != "close":
                    try:
                        tracker.close()
                    except Exception:  # noqa: BLE001 -- it is already broken
                        pass

    def _saved_ids(self) -> dict[str, str]:
        try:
            return {k: v["run_id"] for k, v in json.loads((self.run.run_dir / IDS_FILE).read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none saved, or damaged
            return {}

    def _save_ids(self) -> None:
        ids = {**{k: {"run_id": v} for k, v in self._saved_ids().items()},
               **{t.name: {"run_id": t.run_id} for t in self.active if t.run_id}}
        if not ids:
            return
        path = self.run.run_dir / IDS_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(ids, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            self.warn(f"trackers: could not save their run ids to {path} ({e}); a resumed run will start "
                      "new tracker runs")
