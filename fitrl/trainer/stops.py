"""Why a run stops between its phases, asked as one question (docs/architecture.md, "Stopping").

Four things end a run early, and the loop treats them alike:

- the **memory guard** (:class:`~fitrl.trainer.memory_watch.MemoryWatch`): a process crossed its
  memory limit;
- **SIGINT/SIGTERM** (:data:`~fitrl.trainer.signals.SIGNALS`): a user or a scheduler asked to stop;
- **divergence** (:class:`~fitrl.trainer.divergence.DivergenceJudge`): a complete step's metrics
  show the policy coming apart;
- **an engine gone wrong** (:meth:`RunStops.stop_if_engine_strays`): right after a weight push
  and a wake, the rollout engine's log-probs of its own samples jump away from the trainer's
  (``rollout.mismatch_stop_kl``): its weights are no longer the trainer's.

The loop marks a block whose phases may be abandoned with :meth:`RunStops.stoppable` (a crossing
or a signal inside it is noted, not raised) and asks :meth:`RunStops.safe_point` after it: the
block's step is done or abandoned, here is the driver's state to checkpoint, and (at a step's
end) its metrics for the divergence judge. Each stop then writes what can be kept (the emergency
checkpoint of the last complete step, never of a diverging one), a record in ``metrics.jsonl``
and one line naming where the run continues from.
"""

from __future__ import annotations

import statistics
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from rich.console import Console

from fitrl.algo.mismatch import mismatch_jump
from fitrl.checkpoint import layout
from fitrl.checkpoint.manager import CheckpointManager
from fitrl.config.schema import FitrlConfig
from fitrl.core.errors import Diverged, EngineBroken, Interrupted
from fitrl.models.description import RunModels
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.divergence import DivergenceJudge, vocab_size
from fitrl.trainer.memory_watch import MemoryWatch
from fitrl.trainer.run_log import RunLog
from fitrl.trainer.signals import SIGNALS, signal_name, why_not_save
from fitrl.workers.group import RoleHandle

MISMATCH_WINDOW = 5
"""Steps whose ``rollout/kl`` make the baseline an engine's jump is measured against: a few, so
that a slow drift (the policy's, in overlapped modes) moves the baseline along."""


class RunStops:
    def __init__(self, cfg: FitrlConfig, *, watched: dict[str, RoleHandle], saved: Callable[[], dict[str, RoleHandle]],
                 writer: RunLog, console: Console, checkpoints: Optional[CheckpointManager],
                 models: Optional[RunModels] = None):
        """``watched``: the roles whose processes' memory is watched; ``saved()``: the roles a
        checkpoint holds; ``models``: the run's model descriptions (else the policy's directory is read)."""
        self.cfg, self.writer, self.console, self.checkpoints, self.saved = cfg, writer, console, checkpoints, saved
        vocab = models.actor.vocab_size if models is not None else vocab_size(cfg.actor.model.path)
        self.divergence = DivergenceJudge(cfg.trainer.divergence, vocab)
        self.memory = MemoryWatch(cfg, watched, console, write=writer.write, save=self.emergency_save)
        self.start_step = 0  # the step a resumed run continues after
        self.recent_kl: deque[float] = deque(maxlen=MISMATCH_WINDOW)  # the sound steps' rollout/kl

    @contextmanager
    def stoppable(self) -> Iterator[None]:
        """A block the memory guard or a signal may abandon: the reason is noted, and acted on
        at the next :meth:`safe_point`."""
        with self.memory.catch(), SIGNALS.catch():
            yield

    def safe_point(self, step: int, *, step_done: bool, state: Optional[dict], metrics: Optional[dict] = None,
                   judge: bool = False) -> None:
        """Does the run stop here? ``step_done``: ``step`` is complete (else abandoned, and
        ``state`` is the driver's state before it); ``state`` None: nothing to save; ``judge``:
        ``metrics`` are a complete step's, for the engine check and the divergence judge (judged
        first: such a step is never checkpointed). Raises the stop's exception, or returns."""
        if judge:
            self.stop_if_engine_strays(step, metrics or {})
            self.stop_if_diverged(step, metrics or {})
        self.memory.stop_if_crossed(step, step_done=step_done, state=state, metrics=metrics)
        self.stop_if_signalled(step, step_done=step_done, state=state, metrics=metrics)

    def may_save(self, step: int) -> bool:
        """A checkpoint of ``step`` may replace good ones: no divergence is suspected."""
        if self.divergence.pending:
            self.console.print(f"checkpoint of step {step} skipped: divergence suspected: "
                               f"{self.divergence.pending}", highlight=False)
        return not self.divergence.pending

    def emergency_save(self, step: int, state: dict, metrics: dict) -> Optional[Path]:
        if self.checkpoints is None:
            return None
        if self.divergence.pending:
            self.console.print(f"no emergency checkpoint of step {step}: divergence suspected: "
                               f"{self.divergence.pending}", highlight=False)
            return None
        return self.checkpoints.save(step, self.saved(), state, metrics)

    def resume_text(self) -> str:
        """Where a next run continues from: this run directory's newest resumable checkpoint."""
        found = [c for c in layout.list_complete(self.checkpoints.root) if not c.model_only] if self.checkpoints else []
        if not found:
            return "no checkpoint to resume: a next run starts at step 0"
        point = found[-1]
        how = ("run the same command to continue" if self.cfg.trainer.run_dir and self.cfg.checkpoint.resume == "auto"
               else f"continue with checkpoint.resume={point.path}")
        return f"resume point: {point.path} (step {point.step}); {how}"

    def stop_if_engine_strays(self, step: int, metrics: dict[str, float]) -> None:
        """Ends the run with :class:`EngineBroken` when the step's ``rollout/kl`` (the engine's and
        the trainer's log-probs of the step's sampled tokens, fitrl/algo/mismatch.py) jumps past
        ``rollout.mismatch_stop_kl`` and ``mismatch_stop_factor`` times its recent median. Every
        rollout follows a push and a wake, where a wrong weight load or a reused freed buffer
        shows (SkyRL#1680, vllm-omni#4473): stopping here, before the step's checkpoint, keeps
        the last checkpoint the one before the engine went wrong. No ``rollout/kl`` (the engine's
        own log-probs are the behaviour's): nothing to compare."""
        kl = metrics.get("rollout/kl")
        if kl is None:
            return
        r = self.cfg.rollout
        recent = list(self.recent_kl)
        bound = mismatch_jump(kl, recent, floor=r.mismatch_stop_kl, factor=r.mismatch_stop_factor)
        if bound is None:
            self.recent_kl.append(kl)
            return
        engine, push = self.engine_and_push(step)
        self.writer.write({"step": step, "event": "engine_mismatch", "rollout/kl": kl, "bound": bound,
                           "engine": engine, "push": push})
        base = (f"{r.mismatch_stop_factor:g} x its median {statistics.median(recent):.2g} over the last "
                f"{len(recent)} step(s)" if recent else "no earlier step to compare with")
        raise EngineBroken(f"step {step}: the {engine}'s log-probs of its samples are {kl:.3g} nats/token "
                           f"(rollout/kl) from the trainer's right after {push}, above {bound:.3g} "
                           f"(rollout.mismatch_stop_kl={r.mismatch_stop_kl:g}; {base}): its weights are not the "
                           f"trainer's. Step {step} is not checkpointed; {self.resume_text()} (trainer.max_restarts "
                           "rebuilds the engine and resumes by itself)")

    def engine_and_push(self, step: int) -> tuple[str, str]:
        """The engine that generated step ``step``'s samples, and the weight push they followed."""
        r = self.cfg.rollout
        if r.workers:
            return (f"rollout workers' {r.engine} engine",
                    f"a weight sync to the rollout workers (rollout.mode={r.mode})")
        push = f"the weight push and wake before step {step}'s rollout"
        if step == self.start_step + 1:  # the push that replaced the engine's initial (dummy) weights
            push += f" (its first: the weights of step {self.start_step})"
        return f"policy's {r.trainer_engine} engine", push

    def stop_if_diverged(self, step: int, metrics: dict[str, float]) -> None:
        """Ends the run with :class:`Diverged` when the judge says so (fitrl/trainer/divergence.py):
        metrics.jsonl keeps the step and an event naming the reason; no checkpoint is written."""
        reason = self.divergence.observe(metrics)
        if reason is None:
            return
        self.writer.write({"step": step, "event": "divergence", "reason": reason})
        onset = step - self.divergence.steps_since_onset + 1  # no checkpoint was written from here on
        found = [c for c in layout.list_complete(self.checkpoints.root)
                 if not c.model_only and c.step < onset] if self.checkpoints else []
        if not found:
            last = "no checkpoint of this run precedes it"
        elif found[-1].step == onset - 1:  # signs show one step after the update that caused them
            last = (f"the newest checkpoint, {found[-1].path}, holds step {found[-1].step}, whose own update may have "
                    "started it" + (f" (the one before: {found[-2].path})" if len(found) > 1 else ""))
        else:
            last = f"the newest checkpoint, {found[-1].path} (step {found[-1].step}), is from before it"
        since = f"since step {onset} " if onset < step else ""
        raise Diverged(f"diverged at step {step}: {reason}. No checkpoint was written {since}({last}). A lower "
                       f"actor.optim.lr (now {self.cfg.actor.optim.lr:g}) is the usual cure; trainer.divergence.* sets "
                       "what counts as divergence")

    def stop_if_signalled(self, step: int, *, step_done: bool, state: Optional[dict],
                          metrics: Optional[dict] = None) -> None:
        """After SIGINT/SIGTERM, at a safe point (fitrl/trainer/signals.py): the emergency checkpoint
        of the last complete step when there is time, a record in metrics.jsonl, and
        :class:`Interrupted` with one line."""
        if not SIGNALS.requested(step_done=step_done):
            return
        if state is None:  # stopped before anything was trained (the validation before the first step)
            done = self.start_step
        else:
            done = step if step_done else step - 1
        path, why = None, "checkpoints are off"
        if self.checkpoints is not None:
            why = why_not_save(done=done, start_step=self.start_step,
                               checkpointed=(self.checkpoints.root / f"step_{done}" / layout.MARKER).is_file(),
                               elapsed=SIGNALS.elapsed(), expected_save_s=self.checkpoints.last_save_s,
                               grace_s=self.cfg.trainer.signal_grace_s, divergence=self.divergence.pending)
        if why is None:
            try:
                with PhaseTimer().phase("checkpoint_save", guarded=False):
                    path = self.checkpoints.save(done, self.saved(), state, metrics or {})
            except Exception as e:  # atomic saves: the earlier checkpoints are untouched
                why = f"it failed: {type(e).__name__}: {e}"
        name = signal_name(SIGNALS.signum)
        self.writer.write({"step": step, "event": "signal_stop", "signal": name, "step_done": step_done,
                           "checkpoint": str(path) if path else None, "no_checkpoint_because": why})
        where = f"at step {step}" if step_done else f"during step {step} (abandoned before its update: redone on resume)"
        saved = f"emergency checkpoint of step {done} written" if path else f"no emergency checkpoint ({why})"
        raise Interrupted(f"stopped by {name} {where}: {saved}; {self.resume_text()}", SIGNALS.signum)
