"""Experiment trackers named by ``trainer.loggers``: the interface, one module per tracker, and the
fan-out the trainer writes through. ``metrics.jsonl`` is written by the trainer whatever this list
says; these are the extra views of it.

base         the ``Tracker`` interface, the ``TRACKERS`` registry, package checks
console      ``console``: the trainer's step line (valid name; prints nothing itself)
tensorboard  ``tensorboard``: event files in ``<run_dir>/tensorboard``
wandb_tracker  ``wandb``: Weights & Biases, online or offline, in ``<run_dir>/wandb``
mlflow_tracker ``mlflow``: MLflow, a SQLite store in the run directory by default
fanout       ``Trackers``: open, resume, feed and drop-on-failure every configured tracker

Import-light: the libraries are imported when a tracker opens, so importing this package (the
config loader does, to check names) costs nothing.
"""

from fitrl.tracking import console, mlflow_tracker, tensorboard, wandb_tracker  # noqa: F401 -- register
from fitrl.tracking.base import INSTALL_HINT, TRACKERS, Tracker, TrackerRun, check_installed
from fitrl.tracking.fanout import Trackers

__all__ = ["INSTALL_HINT", "TRACKERS", "Tracker", "TrackerRun", "Trackers", "check_installed"]
