"""Generation ahead of the update: the rollout workers' side of a step (``rollout.workers``,
``rollout.mode``; docs/async.md).

Weights are versioned by the updates they have had: version v is the policy after step v (0: as
loaded, or as resumed at step S: S). Step t trains weights of version t-1, so a sample generated
under version v is ``(t-1) - v`` updates stale when step t trains on it.

The pipeline keeps the generations of steps t+1 .. t+lead in flight while step t trains
(``lead``: 0 sync, 1 one_step_off, ``max_staleness`` async). Step j's generation is asked for
weights of version j-1-lead or newer, and that version was sent before the request (at the end
of step j-1-lead), so no sample is ever staler than ``lead``: the bound holds by construction,
and the driver checks it on every sample (``rollout/staleness_max``). With ``async`` a
generation takes every newer version that arrives between its micro-batches (partial
rollouts), so its samples are usually fresher than the bound.

Data: each step's prompts are drawn when its generation is asked for. A checkpoint of step t
saves the sampler as it was before step t+1's draw, so a resumed run draws the in-flight steps'
prompts again (and regenerates them with the resumed weights): nothing is skipped or repeated
(``prompts.jsonl`` logs each step's rows).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fitrl.config.schema import FitrlConfig, SamplingConfig
from fitrl.data.batch import Batch
from fitrl.data.dataset import PromptDataset, PromptSampler
from fitrl.core.device import resolve_device
from fitrl.distributed.weight_sync import resolve_transport
from fitrl.roles.rollout_worker import compute_dtype
from fitrl.trainer.watchdog import collective_timeout_s
from fitrl.workers.group import Pending, RoleHandle


@dataclass
class Drawn:
    """One step's first round of prompts, drawn, and its generation (in flight or done)."""
    step: int
    prompts: Batch
    rows: list[int]
    sampler_before: dict
    """The sampler's state before this draw: a checkpoint of the step before resumes from it."""
    generation: Optional[Pending] = None


class RolloutPipeline:
    def __init__(self, cfg: FitrlConfig, policy: RoleHandle, rollout: RoleHandle, data: PromptDataset,
                 sampler: PromptSampler, sampling: SamplingConfig):
        self.cfg, self.policy, self.rollout = cfg, policy, rollout
        self.data, self.sampler, self.sampling = data, sampler, sampling
        self.lead = cfg.rollout.lead
        self.partial = cfg.rollout.mode == "async"
        self.version = -1  # the newest weights sent to the rollout workers
        self.first_version = 0
        self.ahead: dict[int, Drawn] = {}
        self.drawn_through: Optional[int] = None  # the last step whose prompts were drawn
        self._busy = (0.0, time.perf_counter())  # the workers' busy seconds and the clock when last read
        self._sent: list[Pending] = []  # weights on their way: a failed delivery raises at the next take
        self._buckets = 0  # the last send's broadcast buckets (collective transport)
        t = cfg.trainer
        self.transport = resolve_transport(cfg.rollout.weight_transport, resolve_device(t.device).type, t.backend)
        if self.transport == "collective":
            self._open_channel(collective_timeout_s(t.hang_timeout_s, t.hang_timeouts))

    # -- weights ------------------------------------------------------------------------------

    def _open_channel(self, timeout_s: float) -> None:
        """The weight channel (fitrl/distributed/weight_sync.py): the policy's rank 0 hosts the
        rendezvous, then it and every worker join at once (each join waits for the others)."""
        address = self.policy.open_weight_channel(self.rollout.world_size, timeout_s)
        joined = self.rollout.submit("join_weight_channel", address)
        self.policy.join_weight_channel(address)
        joined.result()

    def send_weights(self, version: int) -> float:
        """Send the policy's current weights as ``version``; returns the seconds the trainer spent
        (gathering them, and over the weight channel broadcasting them; the workers load them
        between generations, not here)."""
        start = time.perf_counter()
        if self.transport == "collective":
            # the workers take it on their mailbox threads, beside a running generation; the
            # trainer's call returns once the last bucket has left rank 0
            received = self.rollout.submit("receive_broadcast", version, mailbox=True)
            bucket_bytes = int(self.cfg.rollout.weight_bucket_mb * 2**20)
            self._buckets = self.policy.broadcast_weights(compute_dtype(self.cfg), bucket_bytes)
            self._sent.append(received)
            return self._sent_as(version, start)
        # rank 0's full weights, left where they are (under Ray the workers fetch them from the
        # object store; the driver never holds a copy)
        weights = self.policy.group.call_kept("inference_weights", [(compute_dtype(self.cfg),)] * self.policy.world_size,
                                              {})[0]
        self._sent.append(self.rollout.submit("receive_weights", weights, version, mailbox=True))
        return self._sent_as(version, start)

    def _sent_as(self, version: int, start: float) -> float:
        if self.version < 0:
            self.first_version = version
        self.version = version
        return time.perf_counter() - start

    def send_metrics(self) -> dict[str, float]:
        """How the last send travelled: its broadcast buckets over the weight channel (none logged
        for the object store)."""
        return {"rollout/weight_buckets": float(self._buckets)} if self.transport == "collective" else {}

    # -- generations --------------------------------------------------------------------------

    def draw(self, step: int) -> Drawn:
        before = self.sampler.state_dict()
        rows = self.sampler.next_indices()
        return Drawn(step, self.data.batch(rows, f"{step}.1"), rows, before)

    def generate(self, prompts: Batch, sampling: SamplingConfig, min_version: Optional[int] = None,
                 partial: bool = False) -> Pending:
        """Start a generation on the workers under weights of ``min_version`` or newer (default:
        the newest sent)."""
        return self.rollout.submit("generate", prompts, sampling, phase="rollout",
                                   min_version=self.version if min_version is None else min_version, partial=partial)

    def fill(self, through: int) -> None:
        """Ask for the generations of every step up to ``through`` not yet asked for."""
        for j in range(self.drawn_through + 1 if self.drawn_through is not None else through, through + 1):
            d = self.draw(j)
            # weights of version j-1-lead were sent at the end of step j-1-lead, before this request
            d.generation = self.generate(d.prompts, self.sampling, max(self.first_version, j - 1 - self.lead),
                                         self.partial)
            self.ahead[j] = d
            self.drawn_through = j

    def take(self, step: int) -> tuple[Drawn, Batch]:
        """Step ``step``'s drawn prompts and generated rollout, waiting for it (the trainer's idle
        time). Ask for it (:meth:`fill`) first."""
        for sent in [p for p in self._sent if p.done()]:
            self._sent.remove(sent)
            sent.result()  # a failed delivery raises here, not as a wait for weights that never come
        drawn = self.ahead.pop(step)
        return drawn, drawn.generation.result()

    def sampler_state(self, step: int) -> dict:
        """The sampler's state as a checkpoint of ``step`` saves it: before any later step's draw."""
        later = [d for j, d in self.ahead.items() if j > step]
        return min(later, key=lambda d: d.step).sampler_before if later else self.sampler.state_dict()

    # -- metrics ------------------------------------------------------------------------------

    def staleness(self, step: int, batch: Batch) -> dict[str, float]:
        """Updates between the weights that generated each sample and those training on it."""
        versions = batch["rollout_version"].float()
        stale = (step - 1) - versions
        if float(stale.max()) > self.lead or float(stale.min()) < 0:
            raise RuntimeError(f"step {step}: samples of weights versions {sorted(set(versions.long().tolist()))} "
                               f"are outside the staleness bound {self.lead} (a bug: docs/async.md)")
        return {"rollout/staleness_mean": float(stale.mean()), "rollout/staleness_max": float(stale.max()),
                "rollout/weights_version_min": float(versions.min())}

    def worker_idle(self) -> dict[str, float]:
        """The share of the time since the last call the rollout workers spent waiting for work
        (their busy seconds, asked beside any running generation)."""
        busy = self.rollout.group.submit("busy_seconds", [()] * self.rollout.world_size, {}, mailbox=True).result()
        now = time.perf_counter()
        (last_busy, last_t), self._busy = self._busy, (sum(busy) / len(busy), now)  # (every rank's, averaged)
        wall = now - last_t
        return {"rollout/worker_idle_frac": max(0.0, 1.0 - (self._busy[0] - last_busy) / wall) if wall > 0 else 0.0}


class PromptLog:
    """``prompts.jsonl``: the dataset rows drawn by each step (the proof that a resumed run
    neither repeats nor skips a prompt), and the weights versions its samples came from."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "prompts.jsonl"

    def keep_through(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a resume from its checkpoint draws them again);
        a run starting at step 0 keeps an earlier run's file as ``prompts.jsonl.prev``."""
        if not self.path.exists():
            return
        if step == 0:
            self.path.replace(self.path.with_name(self.path.name + ".prev"))
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in lines))

    def write(self, step: int, rows: list[int], batch: Batch) -> None:
        record = {"step": step, "rows": rows}
        if "rollout_version" in batch:
            record["versions"] = sorted(set(batch["rollout_version"].tolist()))
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

