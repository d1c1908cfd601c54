"""Memory telemetry and the guard across processes: two Ray ranks (gloo, FSDP2) report their own
per-phase memory, and a guard crossing in the ranks stops every rank at the same safe point,
the driver writing the emergency checkpoint. Marked slow (each run starts 2 worker processes)."""

import io

import pytest
from rich.console import Console

from fitrl.telemetry.guard import GUARD
from fitrl.core.errors import RunStopped
from fitrl.trainer.run import train
from helpers import read_metrics, toy_config

pytestmark = pytest.mark.slow

RUN = ["data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
       "trainer.device=cpu", "trainer.backend=ray", "trainer.devices_per_node=2", "trainer.val_before_train=false",
       "memory.plan=off", "memory.uss_min_phase_s=0", "algorithm.fold_old_logprob=false"]  # every phase


def test_each_rank_reports_its_phases(ray_cluster, tiny_model_dir, tmp_path):
    train(toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=2", *RUN), Console(file=io.StringIO()))
    rec = [r for r in read_metrics(tmp_path) if "reward/mean" in r][-1]
    for rank in (0, 1):
        for phase in ("rollout", "old_logprob", "update"):
            assert rec[f"mem/policy.rank{rank}/{phase}/host_peak_gib"] > 0.05, (rank, phase)
            assert rec[f"mem/policy.rank{rank}/{phase}/host_uss_gib"] > 0
    assert rec["mem/driver/reward/host_rss_gib"] > 0  # the driver's own phases
    assert "mem/driver/update/host_rss_gib" in rec    # it waits through the ranks' update
    assert rec["mem/leak_warnings"] == 0
    # the step's FLOPs, with the prompt copies each rank's prefill skipped collected from the ranks
    assert rec["perf/step_flops"] > 0 and rec["perf/rollout_mfu"] > 0


def test_guard_in_the_ranks_stops_all_of_them_together(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    # The ranks get a threshold no node meets; the driver keeps its guard off, so the stop can
    # only come from the ranks' safe points (all-reduced: both leave the same micro-batch).
    import fitrl.trainer.memory_watch as watch

    configure = GUARD.configure

    def driver_guard_off(memory_cfg, process=None):
        configure(memory_cfg, process)
        GUARD.settings.enabled = False
    monkeypatch.setattr(watch.GUARD, "configure", driver_guard_off)
    cfg = toy_config(tiny_model_dir, tmp_path, "trainer.max_steps=3", "memory.guard_min_available_gib=1e9", *RUN)
    try:
        with pytest.raises(RunStopped) as info:
            train(cfg, Console(file=io.StringIO()))
    finally:
        GUARD.settings.enabled, GUARD.settings.min_available_bytes = True, None
    msg = str(info.value)
    assert "host memory low during 'rollout' (policy.rank" in msg
    assert "[reported by another rank]" not in msg  # the origin's own numbers are reported
    assert "held (latest phases): driver" in msg and "policy.rank1" in msg
    assert "step_0" in msg  # nothing trained yet: the emergency checkpoint is the initial state
    assert (tmp_path / "checkpoints" / "step_0").is_dir()
