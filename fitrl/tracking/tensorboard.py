"""``tensorboard``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir runs``).

Scalars under their metrics.jsonl names; tables and the config as text (markdown). A run writes
to the same directory as an earlier one in the same run directory and hides that one's events
from the first step it logs (after the checkpoint when resumed, all of them when it starts at
step 0; none for ``trainer.val_only``), so each step shows once.
"""

from __future__ import annotations

import json
from typing import Any

from fitrl.tracking.base import Tracker, TrackerRun, register_tracker, table_columns

LOG_DIR = "tensorboard"


@register_tracker("tensorboard")
class TensorBoardTracker(Tracker):
    requires = ("tensorboard",)

    def __init__(self, run: TrackerRun):
        super().__init__(run)
        # torch's writer needs only the tensorboard package (no tensorboardX)
        from torch.utils.tensorboard import SummaryWriter

        purge = None if run.appends else run.resume_step + 1 if run.resume_step else 0
        self.writer = SummaryWriter(log_dir=str(run.run_dir / LOG_DIR), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a run that dies keeps what it logged

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text(name, markdown_table(rows), global_step=step)
        self.writer.flush()

    def log_config(self, config: dict[str, Any]) -> None:
        # indented four spaces: a markdown code block, shown verbatim
        text = "\n".join("    " + line for line in json.dumps(config, indent=2, default=str).splitlines())
        self.writer.add_text("config", text, global_step=self.run.resume_step)

    def close(self) -> None:
        self.writer.close()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = table_columns(rows)

    def cell(value: Any) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "\\n")  # one table row per sample

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
