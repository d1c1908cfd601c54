"""Experiment trackers (``trainer.loggers``) and generation samples (``generations.jsonl``).

The end-to-end run logs to TensorBoard, W&B (offline) and MLflow (SQLite in the run directory)
and reads each back with the library's own reader: TensorBoard's ``EventAccumulator``, W&B's
transaction-log inspector (``wandb leet inspect --json``) and MLflow's ``MlflowClient``. Nothing
here touches the network: W&B is offline with every directory it writes under tmp, and MLflow's
store is a local file.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitrl.config import load_config
from fitrl.core.errors import ConfigError
from fitrl.tracking import TRACKERS, Tracker, TrackerRun, Trackers, check_installed
from fitrl.tracking.mlflow_tracker import flatten, mlflow_name
from fitrl.tracking.tensorboard import markdown_table
from fitrl.tracking.wandb_tracker import resolve_mode
from fitrl.trainer.generations import pick_samples, table_rows
from helpers import EXAMPLE, read_metrics, toy_config

MEMORY_KEY = "mem/rank0/update/host_peak_gib"  # per process and phase: what fitrl is about
COMPONENTS = {"digits", "closeness", "exact"}  # the arith reward's


# ----------------------------------------------------------------------------- config

def test_unknown_logger_is_rejected_at_config_load():
    with pytest.raises(ConfigError, match=r"unknown tracker trainer.loggers='tensorbord'; did you mean 'tensorboard'"):
        load_config(EXAMPLE, ["trainer.loggers=[console,tensorbord]"])
    cfg = load_config(EXAMPLE, ["trainer.loggers=[console,tensorboard,wandb,mlflow]"])
    assert cfg.trainer.loggers == ["console", "tensorboard", "wandb", "mlflow"]
    assert load_config(EXAMPLE).trainer.loggers == ["console"]


def test_a_missing_package_names_the_extra(monkeypatch, tmp_path, tiny_model_dir):
    from fitrl.trainer.run import train

    monkeypatch.setattr(TRACKERS.get("wandb"), "requires", ("wandb", "fitrl_no_such_module"))
    with pytest.raises(ConfigError) as err:
        check_installed(["console", "wandb"])
    assert str(err.value) == ("trainer.loggers names 'wandb', which needs fitrl_no_such_module (not installed): "
                              "pip install 'fitrl[trackers]'")
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"fitrl\[trackers\]"):  # before the run directory or a model
        train(toy_config(tiny_model_dir, run_dir, "trainer.loggers=[console,wandb]"))
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- pieces

def test_samples_show_one_response_per_prompt_first():
    assert pick_samples(["a", "a", "b", "b", "c", "c"], 4) == [0, 2, 4, 1]
    assert pick_samples(["a", "b"], 8) == [0, 1]
    assert table_rows([{"reward": 1.0, "reward_components": {"exact": 1.0}}]) == [{"reward": 1.0, "reward/exact": 1.0}]


def test_names_and_tables_each_tracker_accepts():
    assert mlflow_name("val/accuracy/mean@4") == "val/accuracy/mean_4"
    assert mlflow_name("mem/rank0/update/host_peak_gib") == "mem/rank0/update/host_peak_gib"
    assert flatten({"actor": {"optim": {"lr": 1e-5}}, "x": []}) == {"actor.optim.lr": "1e-05", "x": "[]"}
    assert markdown_table([{"response": "a|b\nc", "reward": 0.5}]) == \
        "| response | reward |\n|---|---|\n| a\\|b\\nc | 0.5 |"


def test_wandb_mode_is_offline_without_an_api_key(monkeypatch, tmp_path):
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_mode(None) == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert resolve_mode(None) == "online"  # `wandb login` wrote a key
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode(None) == "offline"  # the environment says so
    assert resolve_mode("online") == "online"  # trainer.wandb_mode says so


class Recording(Tracker):
    name = "recording"

    def __init__(self, run: TrackerRun, fail_on: str = ""):
        super().__init__(run)
        self.fail_on, self.calls = fail_on, []

    def log(self, step, metrics):
        if self.fail_on == "log":
            raise OSError(28, "No space left on device")
        self.calls.append((step, metrics))

    def close(self):
        self.calls.append("closed")


class BrokenAtStart(Tracker):
    name = "broken"

    def __init__(self, run):
        raise RuntimeError("server unreachable")

    def log(self, step, metrics):
        raise AssertionError("never opened")


def test_a_failing_tracker_warns_once_and_training_goes_on(monkeypatch, tmp_path):
    monkeypatch.setitem(TRACKERS._items, "broken", BrokenAtStart)
    warnings = []
    trackers = Trackers(["console", "broken"], TrackerRun(run_dir=tmp_path, project="p", name="n"),
                        warn=warnings.append)
    trackers.open({"a": 1})  # a tracker that cannot start: a warning, not an error
    assert trackers.active == [] and len(warnings) == 1 and "server unreachable" in warnings[0]

    good, full = Recording(trackers.run), Recording(trackers.run, fail_on="log")
    trackers.active = [full, good]
    for step in (1, 2, 3):
        trackers.log(step, {"reward/mean": 0.5})
    assert len(warnings) == 2 and "No space left on device" in warnings[1] and "off for the rest" in warnings[1]
    assert trackers.active == [good] and full.calls == ["closed"]
    assert [c[0] for c in good.calls] == [1, 2, 3]


# ----------------------------------------------------------------------------- end to end

def _isolate_wandb(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B offline, silent, and every file it writes (staging, cache, settings) under ``root``."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var, sub in (("WANDB_DIR", "dir"), ("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_CONFIG_DIR", "config")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        mp.setenv(var, str(root / sub))
    for var in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        mp.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_dir):
    """Two steps logged to every tracker, then the same command resumed to step 3."""
    from fitrl.trainer.run import train

    root = tmp_path_factory.mktemp("trackers")
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        _isolate_wandb(mp, root / "wandb-home")
        common = ["trainer.loggers=[console,tensorboard,wandb,mlflow]", "trainer.project_name=fitrl-test",
                  "trainer.log_samples=3", "trainer.log_samples_freq=1", "data.rollout_batch_size=4",
                  "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=8"]
        train(toy_config(tiny_model_dir, run_dir, "trainer.max_steps=2", *common))
        first_ids = json.loads((run_dir / "trackers.json").read_text())
        train(toy_config(tiny_model_dir, run_dir, "trainer.max_steps=3", *common))  # resumes after step 2
        try:
            yield run_dir, first_ids
        finally:
            import wandb

            wandb.teardown()  # the W&B service process


def _steps(run_dir):
    """metrics.jsonl's training records by step."""
    return {r["step"]: r for r in read_metrics(run_dir) if "reward/mean" in r}


@pytest.mark.slow
def test_tensorboard_events_read_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tracked_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = _steps(run_dir)
    for key in ("reward/mean", MEMORY_KEY):
        scalars = events.Scalars(key)
        # each step once: the resumed run purged nothing it had not rewritten
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([steps[i][key] for i in (1, 2, 3)], rel=1e-6), key
    assert [s.step for s in events.Scalars("val/reward/mean")] == [0, 2, 3]
    assert "generations/val/text_summary" in events.Tags()["tensors"]


def _wandb_records(run_file: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_wandb_offline_run_reads_back_and_resumes_the_same_run(tracked_run):
    run_dir, first_ids = tracked_run
    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2  # the first launch and the resumed one
    run_id = first_ids["wandb"]["run_id"]
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"] == run_id
    assert all(f.name == f"run-{run_id}.wandb" for f in run_files)  # one W&B run, continued

    history = {}
    for f in run_files:
        records = _wandb_records(f)
        for r in records:
            if r["type"] == "history":
                history.setdefault(int(r["history"]["step"]["num"]), {}).update(r["history"]["item"])
    first = _wandb_records(run_files[0])
    config = next(r["config"]["update"] for r in first if r["type"] == "config")  # the resolved config
    assert config["actor"]["optim"]["lr"] == load_config(str(run_dir / "config.yaml")).actor.optim.lr
    steps = _steps(run_dir)
    for step in (1, 2, 3):
        for key in ("reward/mean", MEMORY_KEY):
            assert history[step][key] == pytest.approx(steps[step][key], rel=1e-9), (step, key)
    assert history[0]["val/reward/mean"] == pytest.approx(read_metrics(run_dir)[0]["val/reward/mean"])
    # the samples as a W&B table, written beside the run's files
    assert history[1]["generations/train._type"] == "table-file"
    table = json.loads((run_files[0].parent / "files" / history[1]["generations/train.path"]).read_text())
    assert len(table["data"]) == 3
    assert {"step", "split", "prompt", "response", "answer", "reward", "reward/exact"} <= set(table["columns"])


@pytest.mark.slow
def test_mlflow_run_reads_back_and_resumes_the_same_run(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, first_ids = tracked_run
    run_id = first_ids["mlflow"]["run_id"]
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert client.get_experiment(run.info.experiment_id).name == "fitrl-test"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # resumed, not a second run
    steps = _steps(run_dir)
    for key in ("reward/mean", MEMORY_KEY):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(i, pytest.approx(steps[i][key], rel=1e-9)) for i in (1, 2, 3)], key
    assert run.data.params["trainer.max_steps"] == "2"  # parameters keep the values the run started with
    assert run.data.params["actor.optim.lr"] == str(load_config(str(run_dir / "config.yaml")).actor.optim.lr)
    tables = {a.path for a in client.list_artifacts(run_id, "generations")}
    assert {"generations/val_step_0.json", "generations/train_step_1.json", "generations/train_step_3.json"} <= tables


@pytest.mark.slow
def test_generations_jsonl(tracked_run):
    run_dir, _ = tracked_run
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    by = {}
    for row in rows:
        by.setdefault((row["split"], row["step"]), []).append(row)
    assert sorted(by) == [("train", 1), ("train", 2), ("train", 3), ("val", 0), ("val", 2), ("val", 3)]
    assert all(len(v) == 3 for v in by.values())  # trainer.log_samples each
    for row in rows:
        assert set(row) == {"step", "split", "origin", "prompt", "response", "answer", "reward", "reward_components"}
        assert "What is" in row["prompt"] and isinstance(row["response"], str)
        assert set(row["reward_components"]) == COMPONENTS and isinstance(row["reward"], float)
    # one sample per prompt: the three training samples of a step come from three prompts
    assert len({r["prompt"] for r in by[("train", 1)]}) == 3
    # the same validation prompts each time, so a person can follow the answers over training
    assert [r["origin"] for r in by[("val", 0)]] == [r["origin"] for r in by[("val", 3)]]


def test_generation_log_keeps_one_run_per_file(tmp_path):
    import torch

    from fitrl.data.batch import Batch
    from fitrl.trainer.generations import GenerationLog

    batch = Batch(tensors={"scores": torch.tensor([1.0, 0.0, 0.5])}, fields={
        "uid": ["a", "a", "b"], "prompt_text": ["p1", "p1", "p2"], "response_text": ["r1", "r2", "r3"],
        "answer": [3, 3, 4], "source": ["f:1", "f:1", "f:2"], "extra": [{"data_source": "gsm8k"}] * 3})
    path = tmp_path / "generations.jsonl"

    def steps():
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    log = GenerationLog(path, count=2, source_key="data_source")
    for step in (1, 2, 3):
        log.add(step, "train", batch, batch["scores"], {"exact": batch["scores"]})
        log.add(step, "train", batch, batch["scores"], {})  # the step already has its 2 samples
    log.close()
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"step": 1, "split": "train", "source": "gsm8k", "origin": "f:1", "prompt": "p1",
                     "response": "r1", "answer": 3, "reward": 1.0, "reward_components": {"exact": 1.0}}
    assert steps() == [1, 1, 2, 2, 3, 3]

    resumed = GenerationLog(path, count=1)
    resumed.drop_after(2)  # resumed after step 2: the interrupted run's step 3 goes
    resumed.add(3, "val", batch, batch["scores"], {})
    resumed.close()
    assert steps() == [1, 1, 2, 2, 3]

    fresh = GenerationLog(path, count=1)  # a new run from step 0 in the same directory
    fresh.add(1, "train", batch, batch["scores"], {})
    fresh.close()
    assert steps() == [1] and (tmp_path / "generations.jsonl.prev").is_file()
