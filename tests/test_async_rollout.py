"""Rollout workers of their own and overlapped modes (rollout.workers, rollout.mode; docs/async.md):
the weights a worker samples from, the staleness bound under a slow trainer and a slow worker,
and a stopped and resumed asynchronous run that neither repeats nor skips a prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DATA, EXAMPLE, ROOT, read_metrics, toy_config

from fitrl.config import ConfigError, load_config
from fitrl.data.dataset import PromptSampler
from fitrl.trainer.run import train

LEAN = ("trainer.val_before_train=false", "trainer.val_freq=0", "data.val_files=[]", "reward.num_workers=0",
        "checkpoint.save_final=false")


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "event" not in r and "reward/mean" in r]


def prompt_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "prompts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True])
def test_a_sync_worker_samples_from_the_weights_being_trained(tiny_model_dir, tmp_path, lora):
    """A rollout worker of its own with rollout.mode=sync gets every update before it generates:
    its sampling log-probs are the trainer's recomputed ones (to float round-off), so the sent
    weights are exactly the trained weights (with LoRA: the adapters merged into the base), and
    every sample is of the newest version."""
    extra = ("actor.lora.rank=4", "actor.optim.lr=1e-2") if lora else ()
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "rollout.workers=1", "trainer.max_steps=3", *LEAN, *extra)
    assert cfg.old_logprob_source == "pass"
    train(cfg)
    for r in steps(tmp_path / "run"):
        assert r["rollout/logprob_diff_max"] < 1e-5, r
        assert r["rollout/staleness_max"] == 0.0
    assert [p["versions"] for p in prompt_log(tmp_path / "run")] == [[0], [1], [2]]


def test_overlapped_modes_config():
    cfg = load_config(EXAMPLE, ["rollout.mode=one_step_off"])
    assert cfg.rollout.workers == 1 and cfg.rollout.lead == 1
    assert cfg.old_logprob_source == "rollout"  # the PPO ratio against the weights that sampled
    assert load_config(EXAMPLE, ["rollout.mode=async", "rollout.max_staleness=3"]).rollout.lead == 3
    kept = load_config(EXAMPLE, ["rollout.mode=async", "algorithm.rollout_correction.mode=token"])
    assert kept.old_logprob_source == "pass"  # recomputed, importance-weighted: the user's choice
    with pytest.raises(ConfigError, match="dynamic sampling"):
        load_config(EXAMPLE, ["rollout.mode=one_step_off", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="one engine on one device"):
        load_config(EXAMPLE, ["rollout.workers=1", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    assert load_config(EXAMPLE, ["rollout.workers=1", "rollout.engine=vllm"]).rollout.trainer_engine == "hf"


def _slow(cls, method: str, seconds: float, monkeypatch):
    original = getattr(cls, method)

    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)
    slowed._fitrl_dispatch = original._fitrl_dispatch
    monkeypatch.setattr(cls, method, slowed)


@pytest.mark.parametrize("slow", ["trainer", "worker", "worker-requeue"])
def test_no_sample_is_staler_than_the_bound(tiny_model_dir, tmp_path, monkeypatch, slow):
    """async with max_staleness=2. A slow trainer: the worker runs as far ahead as allowed, so each
    step's samples are exactly min(step - 1, 2) updates old (the injected lag is the bound). A slow
    worker (each micro-batch late): new weights arrive during its generations and are taken between
    micro-batches, so steps mix versions and are fresher than the bound; with
    rollout.partial_rollout=requeue the older micro-batches are made again, one version a step.
    Never beyond the bound."""
    from fitrl.roles.rollout_worker import RolloutWorker
    from fitrl.roles.workers import PolicyWorker

    if slow == "trainer":
        _slow(PolicyWorker, "update", 1.0, monkeypatch)  # (10x a generation's time here: timing cannot flip it)
    else:  # every chunk of 2 prompts x 8 samples takes 0.15 s more after its weights are chosen:
        # the trainer waits for the worker, and its next update lands inside the next generation
        original = RolloutWorker._load_newest

        def late(self, at_least=-1):
            original(self, at_least)
            time.sleep(0.15)
        monkeypatch.setattr(RolloutWorker, "_load_newest", late)
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "rollout.mode=async", "rollout.max_staleness=2",
                     f"rollout.micro_batch_size={64 if slow == 'trainer' else 16}", "trainer.max_steps=6", *LEAN,
                     *(["rollout.partial_rollout=requeue"] if slow == "worker-requeue" else []))
    train(cfg)
    rows = steps(tmp_path / "run")
    assert len(rows) == 6
    for step, r in enumerate(rows, start=1):
        assert r["rollout/staleness_max"] <= 2.0
        if slow == "trainer":
            assert r["rollout/staleness_mean"] == r["rollout/staleness_max"] == min(step - 1, 2), r
    log = prompt_log(tmp_path / "run")
    if slow == "worker-requeue":
        assert all(len(p["versions"]) == 1 for p in log), log
        assert any(r["rollout/staleness_max"] < min(step - 1, 2) for step, r in enumerate(rows, start=1)), rows
    elif slow == "worker":
        assert any(len(p["versions"]) > 1 for p in log), log  # a generation took new weights part-way
        assert sum(r["rollout/staleness_mean"] for r in rows[3:]) < 2.0 * 3
        assert rows[-1]["time/rollout"] > 0.1  # the trainer waited for the worker
    else:
        assert max(r["time/rollout"] for r in rows[3:]) < 0.5  # the samples were waiting for the trainer


def _train(run_dir: Path, *extra: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "fitrl.cli", "train", EXAMPLE, f"trainer.run_dir={run_dir}",
            f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "actor.model.path=" + os.environ["FITRL_TEST_MODEL"],
            "trainer.progress_bar=false", "memory.plan=off", *LEAN, *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout)


def test_a_stopped_async_run_resumes_without_repeating_or_skipping_a_prompt(tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM during step 3's update of an async run (steps 4 and 5 generating), then the
    same command: the emergency checkpoint of step 3 saved the sampler as it was before the
    in-flight steps drew, so the resumed run draws them again. Every step's rows are the sampler's
    own sequence (no prompt twice, none skipped), and the resumed steps sampled from weights of
    the resumed version or newer."""
    monkeypatch.setenv("FITRL_TEST_MODEL", str(tiny_model_dir))
    run = tmp_path / "run"
    cmd = ("rollout.mode=async", "rollout.max_staleness=2", "trainer.max_steps=5", "checkpoint.save_freq=0")
    first = _train(run, *cmd, env={"PYTHONPATH": str(ROOT / "tests" / "hooks"), "FITRL_TEST_SIGNAL_AT": "update:3:TERM"})
    assert first.returncode == 143, first.stderr[-2000:]
    assert "emergency checkpoint of step 3" in first.stdout + first.stderr
    # step 3 finished (the stop came at its end), steps 4 and 5 had drawn and were generating
    assert [p["step"] for p in prompt_log(run)] == [1, 2, 3]
    second = _train(run, *cmd)
    assert second.returncode == 0, second.stderr[-2000:]
    log = prompt_log(run)
    assert [p["step"] for p in log] == [1, 2, 3, 4, 5]
    cfg = load_config(EXAMPLE, [])
    sampler = PromptSampler(80, cfg.data.rollout_batch_size, cfg.data.shuffle, cfg.trainer.seed)
    assert [p["rows"] for p in log] == [sampler.next_indices() for _ in range(5)]
    assert all(min(p["versions"]) >= 3 for p in log[3:])
    assert len({r for p in log for r in p["rows"]}) == 5 * cfg.data.rollout_batch_size


@pytest.mark.slow
def test_one_step_off_under_ray(tiny_model_dir, tmp_path, ray_cluster):
    """One trainer rank and one rollout worker, each a Ray actor with one CPU: step k+1's samples
    are generated while step k trains, one update old, and the run learns like any other."""
    cfg = toy_config(tiny_model_dir, tmp_path / "run", "rollout.mode=one_step_off", "trainer.backend=ray",
                     "trainer.devices_per_node=1", "trainer.max_steps=3", *LEAN)
    train(cfg)
    rows = steps(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    assert [p["versions"] for p in prompt_log(tmp_path / "run")] == [[0], [0], [1]]
    assert all(0.0 <= r["rollout/worker_idle_frac"] <= 1.0 for r in rows)
    # the worker's memory is recorded under the phase of its calls, while the trainer trains. A
    # generation's record reaches the row of the step whose collection first finds it finished:
    # step 1's own in row 1; step 2's in row 1 or 2, step 3's in row 2 or 3 (a loaded machine
    # finishes it later), so at least two rows hold one
    key = "mem/rollout.rank0/rollout/host_peak_gib"
    held = [sorted(k for k in r if "rollout.rank0" in k) for r in rows]
    assert key in rows[0] and sum(key in r for r in rows) >= 2, held


@pytest.mark.slow
def test_a_killed_rollout_worker_is_named_restarted_and_then_stops_the_run_loadable(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """The rollout worker (a Ray actor of its own) is SIGKILLed in its 3rd generation of each
    process: while step 3 generates beside step 2's update. trainer.max_restarts=1: the first death
    restarts the run from its newest checkpoint, the cause naming the role, the rank and the call
    it died in; the restarted worker dies again at its own 3rd generation and the run stops with
    that one line, its last checkpoint loadable. Across the restart no step's prompts were drawn
    twice or skipped."""
    pytest.importorskip("ray")
    monkeypatch.setenv("FITRL_TEST_MODEL", str(tiny_model_dir))
    run = tmp_path / "run"
    out = _train(run, "rollout.mode=one_step_off", "trainer.backend=ray", "trainer.devices_per_node=1",
                 "trainer.max_steps=5", "checkpoint.save_freq=1", "trainer.max_restarts=1",
                 env={"FITRL_INJECT_FAULT": "rollout:0:rollout:3:kill"}, timeout=900)
    assert out.returncode == 1, (out.stdout + out.stderr)[-3000:]
    named = "rollout rank 0 on node "
    error = [line for line in out.stderr.splitlines() if line.startswith("fitrl: worker failed")]
    assert error and error[0].startswith("fitrl: worker failed: " + named), out.stderr[-2000:]
    assert "died during 'generate'" in error[0] and "without a Python exception" in error[0], error
    restarts = [r for r in read_metrics(run) if r.get("event") == "restart"]
    assert len(restarts) == 1 and named in restarts[0]["cause"] and "'generate'" in restarts[0]["cause"], restarts
    log = prompt_log(run)
    cfg = load_config(EXAMPLE, [])
    sampler = PromptSampler(80, cfg.data.rollout_batch_size, cfg.data.shuffle, cfg.trainer.seed)
    assert [p["step"] for p in log] == list(range(1, len(log) + 1)) and len(log) >= 2, log
    assert [p["rows"] for p in log] == [sampler.next_indices() for _ in log]
    newest = max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    assert int(newest.name.split("_")[1]) == len(log)
    verify = subprocess.run([sys.executable, "-m", "fitrl.cli", "checkpoint", "verify", str(newest)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0 and "intact" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.slow
def test_multi_turn_episodes_run_on_a_rollout_worker(tiny_model_dir, tmp_path):
    """rollout.agent with rollout.mode=one_step_off (examples/mul_tools.yaml, the calculator tool):
    the worker runs the episodes with its own copy, and the trainer trains on them one update old."""
    cfg = load_config(str(ROOT / "examples" / "mul_tools.yaml"), [
        f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2",
        "data.rollout_batch_size=4", "actor.mini_batch_size=4", "data.max_prompt_length=512",
        "trainer.progress_bar=false", "memory.plan=off", "rollout.mode=one_step_off", *LEAN])
    train(cfg)
    rows = steps(tmp_path / "run")
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0]
    assert all(r["agent/turns"] >= 1 for r in rows)
