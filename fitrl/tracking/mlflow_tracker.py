"""``mlflow``: MLflow tracking, by default in a SQLite database inside the run directory.

Store: ``trainer.mlflow_tracking_uri`` when set, else ``MLFLOW_TRACKING_URI`` when set, else
``sqlite:///<run_dir>/mlflow.db`` with artifacts in ``<run_dir>/mlflow-artifacts``. Why SQLite
and not the ``./mlruns`` file store: MLflow 3 refuses the file store unless
``MLFLOW_ALLOW_FILE_STORE=true`` (it is in maintenance mode). Why ``mlflow-skinny`` plus
SQLAlchemy and Alembic rather than ``mlflow``: the client and the SQL store are all a run needs,
and the full package adds the UI server, scikit-learn, SciPy and more. Viewing a run:
``pip install mlflow`` then ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``.

Metric names keep fitrl's names, with characters MLflow refuses (anything but letters, digits,
``_ - . / : space``) replaced by ``_``. The config becomes parameters (dotted keys) and a
``config.json`` artifact; generation tables become ``generations/<split>_step_<N>.json``
artifacts (MLflow's table format). A resumed run reopens the saved run id.
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from typing import Any

from fitrl.core.nested import flatten as flatten_nested
from fitrl.tracking.base import Tracker, TrackerRun, cell_text, register_tracker, table_columns

METRICS_PER_CALL = 1000  # MLflow's batch limits
PARAMS_PER_CALL = 100
MAX_PARAM_LENGTH = 6000
_REFUSED = re.compile(r"[^\w\-./: ]")


def mlflow_name(key: str) -> str:
    return _REFUSED.sub("_", key)


def flatten(config: dict[str, Any]) -> dict[str, str]:
    """The config as MLflow parameters: dotted names in MLflow's alphabet, values as bounded text."""
    return {mlflow_name(k): str(v)[:MAX_PARAM_LENGTH] for k, v in flatten_nested(config).items()}


@register_tracker("mlflow")
class MlflowTracker(Tracker):
    requires = ("mlflow", "sqlalchemy", "alembic")

    def __init__(self, run: TrackerRun):
        super().__init__(run)
        with warnings.catch_warnings():
            # MLflow's SQL store uses a loader option SQLAlchemy 2.1 deprecates: nothing a user can act on
            warnings.simplefilter("ignore", DeprecationWarning)
            self.client, local = self._client(run)
            self.run_id, self.resumed = self._start_or_resume(run, local)

    @staticmethod
    def _client(run: TrackerRun):
        from mlflow.tracking import MlflowClient

        uri = run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is not None:
            return MlflowClient(tracking_uri=uri), False
        # creating the database runs MLflow's schema migrations, each announced at INFO
        for noisy in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        return MlflowClient(tracking_uri="sqlite:///" + str((run.run_dir / "mlflow.db").resolve())), True

    def _start_or_resume(self, run: TrackerRun, local: bool) -> tuple[str, bool]:
        from mlflow.exceptions import MlflowException

        if run.resume_id is not None:
            try:
                self.client.get_run(run.resume_id)
                self.client.update_run(run.resume_id, status="RUNNING")
                return run.resume_id, True
            except MlflowException:  # the saved run is gone (another store, a deleted db): start anew
                pass
        experiment = self.client.get_experiment_by_name(run.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = (run.run_dir / "mlflow-artifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(run.project, artifact_location=location)
        return self.client.create_run(experiment_id, run_name=run.name).info.run_id, False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=items[i:i + METRICS_PER_CALL])

    def log_table(self, step: int, name: str, rows: list[dict[str, Any]]) -> None:
        columns = table_columns(rows)
        data = {c: [cell_text(r.get(c)) for r in rows] for c in columns}
        with warnings.catch_warnings():  # pandas 3 deprecation notes raised inside MLflow's own code
            warnings.simplefilter("ignore")
            self.client.log_table(self.run_id, data=data, artifact_file=f"{name}_step_{step}.json")

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = flatten(config)
        if self.resumed:  # MLflow parameters cannot change: keep the ones the run started with
            params = {k: v for k, v in params.items() if k not in self.client.get_run(self.run_id).data.params}
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i:i + PARAMS_PER_CALL])
        self.client.log_dict(self.run_id, config, "config.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")
