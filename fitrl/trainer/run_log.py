"""Where a run's records go: ``metrics.jsonl`` (always), the trackers of ``trainer.loggers``
(TensorBoard, W&B, MLflow: :mod:`fitrl.tracking`) and ``generations.jsonl``, behind the one
``write(record)`` the loop already calls.

Trackers get every numeric value of a step or validation record, per-process memory
(``mem/<process>/<phase>/...``) included; events (``{"event": ...}``) stay in metrics.jsonl.
They open at the first record, once the loop knows whether it resumed (``resumed_at``), so a
resumed run continues the same tracker runs. Sample tables wait for the next record and go with
it, so they land at the step they belong to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from fitrl.config import config_to_dict
from fitrl.config.schema import FitrlConfig
from fitrl.data.batch import Batch
from fitrl.roles.reward import REWARD_COMPONENTS, Scored
from fitrl.tracking import TrackerRun, Trackers
from fitrl.tracking.base import finite_numbers
from fitrl.trainer.generations import GENERATIONS_FILE, GenerationLog, table_rows
from fitrl.trainer.logging import MetricsWriter


class RunLog:
    def __init__(self, cfg: FitrlConfig, run_dir: Path, console: Console):
        t = cfg.trainer
        self.cfg, self.console = cfg, console
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self.trackers = Trackers(t.loggers, TrackerRun(
            run_dir=run_dir, project=t.project_name, name=run_dir.name, appends=t.val_only,
            wandb_mode=t.wandb_mode, mlflow_tracking_uri=t.mlflow_tracking_uri), warn=self.warn)
        self.generations = GenerationLog(run_dir / GENERATIONS_FILE, t.log_samples, cfg.data.source_key,
                                         append=t.val_only)
        self.tables: dict[tuple[int, str], list[dict[str, Any]]] = {}
        self.opened = False

    def resumed_at(self, step: int) -> None:
        """The run continues after checkpointed ``step``: reopen the trackers' runs, drop samples
        the interrupted run wrote after it."""
        self.trackers.run.resume_step = step
        self.generations.drop_after(step)

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if "event" in record or "step" not in record:
            return
        self._open()
        self._send_tables()
        self.trackers.log(int(record["step"]), finite_numbers(record))

    def add_samples(self, step: int, split: str, batch: Batch, scored: Optional[Scored] = None) -> None:
        """Samples of a scored rollout (``scored``: its scores and components; None: the batch's
        own ``scores`` and reward components). Training samples only every
        ``trainer.log_samples_freq`` steps."""
        t = self.cfg.trainer
        if not t.log_samples or (split == "train" and not (t.log_samples_freq and step % t.log_samples_freq == 0)):
            return
        scores = scored.scores if scored is not None else batch["scores"]
        components = scored.components if scored is not None else batch.named(REWARD_COMPONENTS)
        rows = self.generations.add(step, split, batch, scores, components)
        if rows:
            self.tables.setdefault((step, f"generations/{split}"), []).extend(table_rows(rows))

    def warn(self, message: str) -> None:
        self.console.print("warning: " + message, style="yellow", markup=False, highlight=False)

    def close(self) -> None:
        if self.opened:
            self._send_tables()
            self.trackers.close()
        self.generations.close()
        self.metrics.close()

    def _open(self) -> None:
        if not self.opened:
            self.opened = True
            self.trackers.open(config_to_dict(self.cfg))

    def _send_tables(self) -> None:
        for (step, name), rows in self.tables.items():
            self.trackers.log_table(step, name, rows)
        self.tables.clear()
