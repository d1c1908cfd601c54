"""Memory during a run on the real loop with the tiny model: per-phase
telemetry in metrics.jsonl, a leak injected into one phase found with its rate, and the guard
stopping a run with an explanation and an emergency checkpoint that a new run resumes from."""

import functools
import io
import json
import re

import numpy as np
import pytest
from rich.console import Console

from fitrl.checkpoint import layout
from fitrl.cli import main
from fitrl.roles.workers import PolicyWorker
from fitrl.telemetry.guard import GUARD
from fitrl.core.errors import RunStopped
from fitrl.trainer.run import train
from helpers import EXAMPLE, read_metrics, toy_config

SMALL = ["data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=2", "actor.micro_batch_size=8",
         "trainer.val_before_train=false", "memory.plan=off"]


def steps(records):
    return [r for r in records if "event" not in r and "reward/mean" in r]


def patch_worker(monkeypatch, method, before):
    """Run ``before(worker)`` ahead of ``PolicyWorker.<method>`` (the dispatch mark is kept)."""
    original = getattr(PolicyWorker, method)

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        before(self)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PolicyWorker, method, wrapped)


@pytest.fixture(autouse=True)
def restore_guard():
    saved = (GUARD.settings, GUARD.process, GUARD.phase)
    yield
    GUARD.settings, GUARD.process, GUARD.phase = saved
    GUARD.deferred = None


def test_telemetry_per_phase_in_metrics_and_console(tiny_model_dir, tmp_path):
    out = io.StringIO()
    train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=2", "memory.uss_min_phase_s=0", *SMALL),
          Console(file=out, width=250))
    rec = steps(read_metrics(tmp_path))[-1]
    for phase in ("rollout", "old_logprob", "update"):
        for field in ("host_rss_gib", "host_peak_gib", "host_uss_gib", "node_available_gib"):
            assert rec[f"mem/rank0/{phase}/{field}"] > 0, (phase, field)
        assert rec[f"mem/rank0/{phase}/host_peak_gib"] >= rec[f"mem/rank0/{phase}/host_rss_gib"] - 1e-9
    assert rec["mem/host_peak_gib"] == max(v for k, v in rec.items() if k.endswith("/host_peak_gib")
                                           and k.count("/") == 3)
    assert rec["mem/leak_warnings"] == 0
    assert re.search(r"host peak \d+\.\d\dG \(\w+@rank0\) avail \d+\.\dG", out.getvalue())


@pytest.mark.slow
def test_leak_injected_into_one_phase_is_named_with_its_rate(tiny_model_dir, tmp_path, monkeypatch):
    leak_mib, held = 8, []

    def leak(worker):  # touched pages (ones), so RSS really grows by 8 MiB per step
        held.append(np.ones(leak_mib * 2**20, dtype=np.uint8))
    patch_worker(monkeypatch, "compute_logprob", leak)
    train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=40", "memory.leak_warmup_steps=5", *SMALL),
          Console(file=io.StringIO()))
    events = [r for r in read_metrics(tmp_path) if r.get("event") == "memory_leak"]
    assert events, "no leak warning"
    first = events[0]
    assert (first["process"], first["phase"], first["kind"]) == ("rank0", "old_logprob", "host")
    assert abs(first["rate_mib_per_step"] - leak_mib) <= 0.2 * leak_mib, first
    assert first["runs_out_at_step"] > first["step"]
    assert "old_logprob" in first["message"] and "MiB/step" in first["message"]
    assert {(e["process"], e["phase"]) for e in events} == {("rank0", "old_logprob")}


@pytest.mark.slow
def test_guard_abandons_a_read_only_phase_and_checkpoints_the_last_step(tiny_model_dir, tmp_path, monkeypatch):
    def strict_from_step_4(worker):  # the run's threshold raised above what any node has
        if worker.actor.num_updates == 3:
            GUARD.settings.min_available_bytes = 2**60
    patch_worker(monkeypatch, "generate", strict_from_step_4)
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=6", *SMALL)
    with pytest.raises(RunStopped) as info:
        train(cfg, Console(file=io.StringIO()))
    msg = str(info.value)
    assert "host memory low during 'rollout' (rank0)" in msg
    assert "step 4 was abandoned before any weight changed" in msg
    assert "emergency checkpoint" in msg and "step_3" in msg
    assert "rollout.micro_batch_size" in msg and re.search(r"held \(latest phases\): rank0 [0-9.]+ GiB RSS", msg)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in steps(records)] == [1, 2, 3]
    stop = [r for r in records if r.get("event") == "memory_guard_stop"]
    assert stop and stop[0]["phase"] == "rollout" and stop[0]["checkpoint"].endswith("step_3")

    # the checkpoint loads: a new run resumes after step 3 and finishes
    monkeypatch.undo()
    GUARD.settings.min_available_bytes = None
    history = train(toy_config(tiny_model_dir, tmp_path / "resumed", "trainer.max_steps=5",
                               f"checkpoint.resume={stop[0]['checkpoint']}", *SMALL), Console(file=io.StringIO()))
    assert len(history) == 5  # 3 carried over + steps 4 and 5
    assert [r["step"] for r in steps(read_metrics(tmp_path / "resumed"))][-2:] == [4, 5]


@pytest.mark.slow
def test_guard_finishes_an_update_then_stops_after_the_step(tiny_model_dir, tmp_path, monkeypatch):
    def strict_during_update_2(worker):
        if worker.actor.num_updates == 1:
            GUARD.settings.min_available_bytes = 2**60
    patch_worker(monkeypatch, "update", strict_during_update_2)
    with pytest.raises(RunStopped) as info:
        train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=6", *SMALL), Console(file=io.StringIO()))
    msg = str(info.value)
    assert "step 2 completed (its update had started and was finished)" in msg
    assert "step_2" in msg
    assert [r["step"] for r in steps(read_metrics(tmp_path))] == [1, 2]


@pytest.mark.slow
def test_cli_threshold_above_the_node_stops_with_exit_1_and_a_loadable_checkpoint(tiny_model_dir, tmp_path, capsys):
    code = main(["train", EXAMPLE, f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path}",
                 "trainer.progress_bar=false", "trainer.max_steps=3", "memory.guard_min_available_gib=1e9", *SMALL])
    err = capsys.readouterr().err
    assert code == 1
    assert "fitrl: run stopped: memory guard: host memory low" in err
    assert "under the guard's 1000000000.00 GiB" in err
    ckpt = tmp_path / "checkpoints" / "step_0"
    assert json.loads((ckpt / layout.MARKER).read_text())["step"] == 0  # complete (its marker is written last)
    # loadable: resume from it with the guard back to its default
    code = main(["train", EXAMPLE, f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'again'}",
                 "trainer.progress_bar=false", "trainer.max_steps=1", f"checkpoint.resume={ckpt}", *SMALL])
    assert code == 0


@pytest.mark.slow
def test_clean_100_step_run_warns_nothing_and_holds_its_memory(tiny_model_dir, tmp_path):
    import statistics

    train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=100", "trainer.val_freq=0",
                     "checkpoint.save_final=false", *SMALL), Console(file=io.StringIO()))
    records = read_metrics(tmp_path)
    assert not [r for r in records if r.get("event") == "memory_leak"]
    rss = [r["mem/rank0/update/host_rss_gib"] for r in steps(records) if r["step"] > 5]
    # 10-step means: single readings scatter by ~1 % (allocator noise); bench/memory_growth.py measures it
    growth = statistics.fmean(rss[-10:]) / statistics.fmean(rss[:10]) - 1
    assert growth < 0.02, f"host memory grew {growth:.2%} after warm-up"
