"""The exactness bar: a training process killed with SIGKILL (at a random step after a checkpoint,
or in the middle of writing one) and resumed writes the same metrics.jsonl as a run that was
never interrupted (timing and memory readings aside).

The run to kill is a subprocess whose test hook (patched in by the script below, nothing in
fitrl) sends SIGKILL to its own process at a chosen point: deterministic, no timing races.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fitrl.checkpoint import layout
from helpers import read_metrics, toy_config

pytestmark = pytest.mark.slow  # multi-step runs or worker processes: not in the fast tier

HERE = Path(__file__).resolve().parent
STEPS = 7
COMMON = ["trainer.max_steps=%d" % STEPS, "checkpoint.save_freq=2", "trainer.val_freq=2",
          "data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=2", "actor.micro_batch_size=8"]

# argv: model_dir run_dir kind k. kind=step: die inside step k's policy update (its rollout and
# rewards done, its metrics not yet written); kind=save: die while checkpoint step_k is written
# (the actor's shards are on disk, the marker is not).
CHILD = textwrap.dedent("""
    import functools, os, signal, sys
    sys.path.insert(0, {tests!r})
    from helpers import toy_config
    from fitrl.roles.workers import PolicyWorker
    from fitrl.trainer.run import train
    import fitrl.checkpoint.manager as manager

    model, run, kind, k, overrides = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if kind == "step":
        update = PolicyWorker.update
        @functools.wraps(update)  # keeps the dispatch mark
        def update_then_die(self, batch):
            if self.actor.num_updates + 1 == k:
                die()
            return update(self, batch)
        PolicyWorker.update = update_then_die
    else:
        copy = manager.copy_hf_files
        def copy_then_die(cfg, dest):
            if dest.parent.name.startswith(f"step_{{k}}.tmp-"):
                die()
            return copy(cfg, dest)
        manager.copy_hf_files = copy_then_die
    train(toy_config(model, run, *overrides))
""").format(tests=str(HERE))

VOLATILE = ("time/", "mem/", "val/time", "perf/")


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    from fitrl.trainer.run import train

    run = tmp_path_factory.mktemp("uninterrupted")
    train(toy_config(tiny_model_dir, run, *COMMON))
    return comparable(read_metrics(run))


def run_killed(model_dir, run, kind: str, k: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(run), kind, str(k), *COMMON],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # only if the hook never fired: end the child's own session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed (exit {proc.returncode}):\n{out[-3000:]}"


def test_sigkill_at_a_random_step_then_resume_is_exact(tiny_model_dir, tmp_path, uninterrupted):
    from fitrl.trainer.run import train

    # after the step-2 checkpoint, at any later step; FITRL_KILL_STEP=k replays a failure
    kill_step = int(os.environ.get("FITRL_KILL_STEP") or random.randint(3, STEPS))
    run = tmp_path / "run"
    run_killed(tiny_model_dir, run, "step", kill_step)
    newest = layout.list_complete(run / "checkpoints")[-1].step
    assert newest == (kill_step - 1) // 2 * 2, f"killed in step {kill_step}"
    written = [r["step"] for r in read_metrics(run) if "reward/mean" in r]
    assert written == list(range(1, kill_step)), f"killed in step {kill_step}"

    train(toy_config(tiny_model_dir, run, *COMMON))  # checkpoint.resume=auto: the newest in trainer.run_dir
    assert comparable(read_metrics(run)) == uninterrupted, f"killed in step {kill_step}, resumed at {newest}"


def test_kill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, uninterrupted):
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    run_killed(tiny_model_dir, run, "save", 4)
    root = run / "checkpoints"
    assert [c.step for c in layout.list_complete(root)] == [2]
    partial = [d.name for d in root.iterdir() if d.name.startswith("step_4.tmp-")]
    assert len(partial) == 1 and (root / partial[0] / "actor" / ".metadata").is_file()  # shards were written
    layout.read(root / "step_2")  # intact, every file as saved

    train(toy_config(tiny_model_dir, run, *COMMON))
    assert not (root / partial[0]).exists()  # cleaned at the start of the resumed run
    assert comparable(read_metrics(run)) == uninterrupted
    assert [c.step for c in layout.list_complete(root)] == [2, 4, 6, 7]
