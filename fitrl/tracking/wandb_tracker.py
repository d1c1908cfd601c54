"""``wandb``: Weights & Biases, online or offline, files in ``<run_dir>/wandb``.

Mode: ``trainer.wandb_mode`` when set, else ``WANDB_MODE`` when set, else ``online`` when an
API key is configured (``WANDB_API_KEY``, or a netrc entry for the W&B host as ``wandb login``
writes) and ``offline`` otherwise: a run never stops at W&B's login prompt and never needs a
network it was not told about. An offline run is uploaded later with ``wandb sync``.

Resume: the run id is saved in the run directory; a resumed fitrl run opens the same W&B run
(``resume="allow"``). Offline, the continuation is a second offline directory with the same id,
which ``wandb sync`` appends to the same run.
"""

from __future__ import annotations

import netrc
import os
from typing import Any, Optional
from urllib.parse import urlparse

from fitrl.tracking.base import Tracker, TrackerRun, cell_text, register_tracker, table_columns


def api_key_configured() -> bool:
    """Whether W&B can authenticate without asking: the environment or a netrc entry. Reads
    files only; nothing is sent anywhere."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return bool(host and netrc.netrc(os.environ.get("NETRC")).authenticators(host))
    except (OSError, netrc.NetrcParseError):  # no netrc file (the usual case), or an unreadable one
        return False


def resolve_mode(configured: Optional[str]) -> str:
    if configured:
        return configured
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if api_key_configured() else "offline"


@register_tracker("wandb")
class WandbTracker(Tracker):
    requires = ("wandb",)

    def __init__(self, run: TrackerRun):
        super().__init__(run)
        import wandb

        self.wandb = wandb
        self.mode = resolve_mode(run.wandb_mode)
        self.wb_run = wandb.init(
            project=run.project, name=run.name, dir=str(run.run_dir), mode=self.mode,
            id=run.resume_id, resume="allow" if run.resume_id else None,
            # console capture off: fitrl's step lines are in metrics.jsonl already, and wrapping
            # stdout under a live progress bar garbles both
            settings=wandb.Settings(console="off"))
        self.run_id = self.wb_run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.wb_run.log(metrics, step=step)

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = table_columns(rows)
        table = self.wandb.Table(columns=columns, data=[[cell_text(r.get(c)) for c in columns] for r in rows])
        self.wb_run.log({name: table}, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        # a resumed run may carry changed values (checkpoint.strict_config=false): keep the new ones
        self.wb_run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        self.wb_run.finish()
