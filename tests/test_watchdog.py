"""The hang watchdog (fitrl/trainer/watchdog.py): a phase with no progress for its limit stops the
run with the phase, the stuck process and its stack named, a `hang` event and exit status 1."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from fitrl.config import ConfigError, load_config
from fitrl.telemetry.progress import PROGRESS, Progress
from fitrl.trainer.watchdog import HangWatchdog
from helpers import DATA, EXAMPLE, ROOT

HANGING_REWARD = '''
import time
CALLS = [0]

def reward(response, answer):
    CALLS[0] += 1
    if CALLS[0] > 64:  # the second step's scoring never returns (a step scores 8 prompts x 8 samples)
        for _ in range(3000):
            time.sleep(0.1)
    return 0.0
'''


def test_progress_reports_its_phase_idle_time_and_stack():
    p = Progress()
    p.enter("rollout")
    report = p.report()
    assert report["phase"] == "rollout" and report["idle_s"] < 5 and "test_progress_reports" in report["stack"]


def test_a_quiet_phase_fires_only_past_its_limit(monkeypatch):
    fired = []
    dog = HangWatchdog(lambda phase: 5.0, lambda timeout: [{"role": "policy", "rank": 1, "idle_s": 1.0, "stack": ""}],
                       report=lambda text, event: fired.append(event) or "resume")
    monkeypatch.setattr(PROGRESS, "phase", "update")
    monkeypatch.setattr(PROGRESS, "last", time.monotonic() - 10)
    assert not dog.check() and not fired  # rank 1 beat a second ago: the phase is working
    dog.ranks = lambda timeout: [{"role": "policy", "rank": 1, "idle_s": 9.0, "stack": "  File x\n"},
                                 {"role": "policy", "rank": 0, "idle_s": None, "error": "no reply"}]
    monkeypatch.setattr(dog, "fire", lambda phase, limit, ranks: fired.append((phase, limit, len(ranks))))
    assert dog.check() and fired == [("update", 5.0, 2)]
    monkeypatch.setattr(PROGRESS, "phase", None)
    assert not dog.check()  # between phases: nothing to judge


RESTARTED_AFTER_A_HANG = '''
import time
import fitrl.trainer.watchdog as w
from fitrl.core.errors import Hung
from fitrl.telemetry.progress import PROGRESS

w.EXIT_GRACE_S = 1.0
dog = w.HangWatchdog(lambda phase: 0.5, lambda timeout: [], report=lambda text, event: "resume", poll_s=0.1)
PROGRESS.enter("update")
try:
    with dog:
        for _ in range(100):  # a hang in Python code: the stop arrives at the next instruction
            time.sleep(0.05)
except Hung:
    pass
time.sleep(3)  # a restarted run going on past the grace, with a watchdog of its own
print("went on")
'''


def test_a_main_thread_that_took_the_stop_is_not_ended_after_the_grace():
    """The watchdog's grace ends with ``os._exit`` only while the main thread is still inside the
    watched block: one that took the stop and went on (a restart) keeps running."""
    proc = subprocess.run([sys.executable, "-c", RESTARTED_AFTER_A_HANG], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "went on", proc.stderr[-2000:]
    assert "still stuck" not in proc.stderr


def test_bad_limits_are_one_line():
    with pytest.raises(ConfigError, match=r"trainer.hang_timeouts.update must be a number of seconds >= 0"):
        load_config(str(EXAMPLE), ["trainer.hang_timeouts={update: -1}"])


@pytest.mark.slow
def test_a_hung_reward_stops_the_run_naming_the_phase_and_the_stack(tiny_model_dir, tmp_path):
    reward = tmp_path / "hanging.py"
    reward.write_text(HANGING_REWARD)
    run = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fitrl.cli", "train", str(EXAMPLE), f"actor.model.path={tiny_model_dir}",
         f"trainer.run_dir={run}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]",
         f"reward.function={reward}:reward", "reward.num_workers=0", "trainer.max_steps=4",
         "checkpoint.save_freq=1", "trainer.hang_timeout_s=10", "trainer.progress_bar=false", "memory.plan=off"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "hang: phase 'reward' made no progress for 10 s (trainer.hang_timeout_s); stuck: the driver" in out
    assert "hanging.py" in out and "time.sleep(0.1)" in out  # the user's frame, from the main thread's stack
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fitrl: hang: phase 'reward' made no progress for 10 s") and "step_1" in last, last
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    hang = [e for e in events if e.get("event") == "hang"]
    assert hang and hang[0]["phase"] == "reward" and hang[0]["step"] == 2
    assert "hanging.py" in (run / "hang.txt").read_text()
    assert took < 300  # (limit 10 s; the rest is start-up on a loaded machine)


@pytest.mark.slow
@pytest.mark.parametrize("phase,restarts", [("update", 0), ("rollout", 1)])
def test_a_rank_hung_in_its_update_is_named_with_its_stack(tiny_model_dir, tmp_path, phase, restarts):
    """Two Ray ranks (gloo, FSDP2); rank 1's second call in ``phase`` never returns (in the update,
    rank 0 waits in its collective): the watchdog names them, with rank 1's stack where it is
    stuck, and the main thread gets the stop at once (no exit after a grace). With a restart
    left, the run resumes from step 1 and finishes (the new rank's 2nd call would be step 3)."""
    pytest.importorskip("ray")
    run = tmp_path / "run"
    env = {**__import__("os").environ, "FITRL_INJECT_FAULT": f"policy:1:{phase}:2:hang"}
    proc = subprocess.run(
        [sys.executable, "-m", "fitrl.cli", "train", str(EXAMPLE), f"actor.model.path={tiny_model_dir}",
         f"trainer.run_dir={run}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]",
         "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", "trainer.backend=ray", "trainer.devices_per_node=2", "trainer.max_steps=2",
         "checkpoint.save_freq=1", "trainer.hang_timeout_s=10", f"trainer.max_restarts={restarts}",
         "trainer.progress_bar=false", "memory.plan=off"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    waiting = " (policy rank 0 waiting in a collective)" if phase == "update" else ""  # (generation has none)
    assert (f"hang: phase {phase!r} made no progress for 10 s (trainer.hang_timeout_s); stuck: policy rank 1"
            + waiting) in out, out[-3000:]
    assert "fault_point" in out  # rank 1's own main-thread stack, from its health thread
    assert "still stuck" not in out  # the main thread took the stop: no exit after the grace
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if restarts:
        assert proc.returncode == 0, out[-3000:]
        assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
        restart = [r for r in records if r.get("event") == "restart"]
        assert [r["step"] for r in restart] == [1] and restart[0]["cause"].startswith("Hung: phase 'rollout'")
        return
    assert proc.returncode == 1, out[-3000:]
    assert "step_1" in proc.stderr.strip().splitlines()[-1]  # the resume point: the last complete checkpoint
    hang = [r for r in records if r.get("event") == "hang"]
    assert hang[0]["phase"] == phase and hang[0]["step"] == 2 and set(hang[0]["ranks"]) == {"policy.rank0",
                                                                                              "policy.rank1"}


def ray_run(tiny_model_dir, run, *extra, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fitrl.cli", "train", str(EXAMPLE), f"actor.model.path={tiny_model_dir}",
         f"trainer.run_dir={run}", f"data.train_files=[{DATA / 'arith_train.jsonl'}]", "data.val_files=[]",
         "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", "trainer.backend=ray", "trainer.devices_per_node=2", "checkpoint.save_freq=1",
         "trainer.progress_bar=false", "memory.plan=off", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=900, env={**__import__("os").environ, **(env or {})})


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_newest_checkpoint_and_the_run_reads_as_one(tiny_model_dir, tmp_path):
    """Rank 1 is SIGKILLed in its 2nd update of each process: at step 2, then (its new process
    counting again from the resume at step 1) at step 3. With trainer.max_restarts=2 the run
    finishes its 3 steps, each recorded once, with the same metrics as a run never killed
    (checkpoints every step, exact resume on CPU). With 0, a kill mid-generation stops the run
    naming the rank and the phase, its last checkpoint loadable."""
    pytest.importorskip("ray")
    killed = ray_run(tiny_model_dir, tmp_path / "killed", "trainer.max_steps=3", "trainer.max_restarts=2",
                     env={"FITRL_INJECT_FAULT": "policy:1:update:2:kill"})
    assert killed.returncode == 0, (killed.stdout + killed.stderr)[-3000:]
    assert killed.stdout.count("restart ") == 2 and "restart 2 of trainer.max_restarts=2" in killed.stdout
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # none lost, none twice
    restarts = [r for r in records if r.get("event") == "restart"]
    assert [(r["step"], r["restart"]) for r in restarts] == [(1, 1), (2, 2)]
    assert "policy" in restarts[0]["cause"] and "rank 1" in restarts[0]["cause"]
    plain = ray_run(tiny_model_dir, tmp_path / "plain", "trainer.max_steps=3")
    assert plain.returncode == 0, plain.stderr[-2000:]
    same = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    same = [r for r in same if "reward/mean" in r]
    for a, b in zip(steps, same):
        for key in ("reward/mean", "actor/grad_norm", "actor/entropy", "response/length_mean"):
            assert a[key] == b[key], (a["step"], key)
    # max_restarts=0: it stops as before; here rank 1 dies mid-generation (its 2nd rollout call)
    stopped = ray_run(tiny_model_dir, tmp_path / "stopped", "trainer.max_steps=3",
                      env={"FITRL_INJECT_FAULT": "policy:1:rollout:2:kill"})
    assert stopped.returncode == 1, stopped.stderr[-2000:]
    error = [line for line in stopped.stderr.splitlines() if line.startswith("fitrl: worker failed")]
    assert error and error[0].startswith("fitrl: worker failed: policy rank 1 on node "), stopped.stderr[-2000:]
    assert "died during 'generate'" in error[0], error  # (the rank's method: the rollout phase's call)
    verify = subprocess.run([sys.executable, "-m", "fitrl.cli", "checkpoint", "verify",
                             str(tmp_path / "stopped" / "checkpoints" / "step_1")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # the last complete step's checkpoint loads
