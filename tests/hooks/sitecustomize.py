"""Test-only hook (tests/test_bad_runs.py): a ``fitrl`` process sends itself signals at chosen
points of a run, so signal handling is tested deterministically, without timing.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the tests put this directory on
``PYTHONPATH`` of the subprocess they start. Nothing in fitrl knows about it. With

    FITRL_TEST_SIGNAL_AT="WHEN:STEP:SIG[,WHEN:STEP:SIG...]"

the process sends itself SIGSIG (``TERM`` or ``INT``) as the phase WHEN of RL step STEP begins
(``data``, ``rollout``, ``reward``, ``old_logprob``, ``update``, ...: inside the phase, so the
run must carry it to its end), or with WHEN=``save`` while checkpoint ``step_STEP`` is being
written (its shards on disk, its marker not). Each entry fires once. The variable is removed from
the environment at once, so the processes the run starts (reward workers) do not act on it.
"""

import os
import signal

_SPEC = os.environ.pop("FITRL_TEST_SIGNAL_AT", "")


def _install(spec: str) -> None:
    from contextlib import contextmanager

    import fitrl.checkpoint.manager as manager
    from fitrl.telemetry.timer import PhaseTimer
    from fitrl.trainer.loop import RLTrainer

    pending = []
    for item in spec.split(","):
        when, step, sig = item.split(":")
        pending.append((when, int(step), getattr(signal, "SIG" + sig)))
    state = {"step": 0}

    def fire(when: str, step: int) -> None:
        for entry in list(pending):
            if entry[:2] == (when, step):
                pending.remove(entry)
                os.kill(os.getpid(), entry[2])  # handled synchronously, before the next bytecode

    train_step = RLTrainer.train_step

    def train_step_noting(self, step):
        state["step"] = step
        return train_step(self, step)

    phase = PhaseTimer.phase

    @contextmanager
    def phase_firing(self, name, guarded=True):
        with phase(self, name, guarded):
            if name != "validation":  # a validation is not part of the step that precedes it
                fire(name, state["step"])
            yield

    copy_hf_files = manager.copy_hf_files

    def copy_firing(cfg, dest):
        name = dest.parent.name
        if ".tmp-" in name:
            fire("save", int(name.split(".tmp-")[0].split("_")[1]))
        return copy_hf_files(cfg, dest)

    RLTrainer.train_step = train_step_noting
    PhaseTimer.phase = phase_firing
    manager.copy_hf_files = copy_firing


if _SPEC:
    _install(_SPEC)
