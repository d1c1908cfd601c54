"""The RL loop as visible dataflow (docs/architecture.md, "One step's data flow"). Each phase is
one timed call on a role.

The driver never assumes one process: roles are reached through :class:`RoleHandle`, data
moves as :class:`Batch`, and what the driver computes itself (rewards, advantages) is cheap
per-sequence math.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console

from fitrl.algo.advantages import compute_advantages, scores_to_token_rewards
from fitrl.algo.filtering import group_is_informative
from fitrl.algo.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalized_rewards
from fitrl.algo.mismatch import mismatch_metrics
from fitrl.checkpoint.layout import Checkpoint
from fitrl.checkpoint.manager import CheckpointManager
from fitrl.config.choices import algorithm_needs
from fitrl.config.schema import FitrlConfig
from fitrl.core.errors import Interrupted
from fitrl.data.batch import Batch
from fitrl.data.dataset import PromptDataset, PromptSampler
from fitrl.models.description import RunModels
from fitrl.roles.reward import REWARD_COMPONENTS
from fitrl.roles.reward_sources import RewardSources
from fitrl.telemetry.memory import host_memory
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.collect import FirstRound, RolloutCollector, group_index
from fitrl.trainer.logging import format_step_line, make_progress
from fitrl.trainer.perf import StepPerf, skipped_prompts
from fitrl.trainer.pipeline import PromptLog, RolloutPipeline
from fitrl.trainer.run_log import RunLog
from fitrl.trainer.signals import SIGNALS
from fitrl.trainer.stops import RunStops
from fitrl.trainer.watchdog import HangWatchdog, write_hang_file
from fitrl.trainer.validation import ValidationSplits, summary as validation_summary
from fitrl.workers.group import RoleHandle


def response_stats(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) response lengths and (B,) truncated flags (never emitted EOS within the budget)."""
    return batch["response_mask"].sum(-1).float(), batch["finished"] == 0


def sequence_metrics(scores: torch.Tensor, components: dict[str, torch.Tensor], lengths: torch.Tensor,
                     truncated: torch.Tensor, prefix: str) -> dict[str, float]:
    m = {
        f"{prefix}reward/mean": scores.mean().item(),
        f"{prefix}reward/std": scores.std().item() if len(scores) > 1 else 0.0,
        f"{prefix}reward/max": scores.max().item(),
        f"{prefix}response/length_mean": lengths.mean().item(),
        f"{prefix}response/length_max": lengths.max().item(),
        f"{prefix}response/clip_ratio": truncated.float().mean().item(),
    }
    m.update({f"{prefix}reward/{k}": v.mean().item() for k, v in components.items()})
    return m


def masked_stats(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = x[mask.bool()]
    if valid.numel() == 0:
        return {}
    return {f"{name}/mean": valid.mean().item(), f"{name}/max": valid.max().item(), f"{name}/min": valid.min().item()}


def teacher_metrics(batch: Batch, mask: torch.Tensor) -> dict[str, float]:
    """The teacher on the step's samples: its mean log-prob of the sampled tokens and, with its
    top-k, ``distill/teacher_agreement``, the fraction of sampled tokens that are its top-1."""
    valid = mask.bool()
    m = {"distill/teacher_logprob": batch["teacher_logprobs"][valid].mean().item() if valid.any() else 0.0}
    if "teacher_topk_ids" in batch:
        top1 = batch["teacher_topk_ids"][..., 0] == batch["responses"]  # (B, R)
        m["distill/teacher_agreement"] = top1[valid].float().mean().item() if valid.any() else 0.0
    return m


class RLTrainer:
    def __init__(self, cfg: FitrlConfig, *, policy: RoleHandle, ref: Optional[RoleHandle],
                 critic: Optional[RoleHandle], train_data: Optional[PromptDataset],
                 val_data: Optional[PromptDataset], reward: RewardSources, run_dir: Path, console: Console,
                 pad_id: int, checkpoints: Optional[CheckpointManager] = None,
                 history: Optional[list[dict[str, float]]] = None, rollout: Optional[RoleHandle] = None,
                 teacher: Optional[RoleHandle] = None, models: Optional[RunModels] = None):
        """``rollout``: rollout workers of their own (``rollout.workers``): they generate the
        training samples, the policy only validation's (fitrl/trainer/pipeline.py). ``teacher``:
        on-policy distillation's (``algorithm.distill``), scoring every step's rollout. ``models``:
        the run's model descriptions (fitrl/models/description.py; else the directories are read)."""
        self.cfg, self.policy, self.ref, self.critic, self.teacher = cfg, policy, ref, critic, teacher
        self.train_data, self.val_data, self.reward = train_data, val_data, reward
        self.run_dir, self.console = run_dir, console
        self.writer = RunLog(cfg, run_dir, console)  # metrics.jsonl, trainer.loggers, generations.jsonl
        algo = cfg.algorithm
        self.train_sampling, self.val_sampling = cfg.rollout.sampling(), cfg.rollout.val_sampling()
        self.collector, self.pipeline = None, None
        self.prompt_log = PromptLog(run_dir)
        if train_data is not None:
            sampler = PromptSampler(len(train_data), cfg.data.rollout_batch_size, cfg.data.shuffle, cfg.trainer.seed)
            generate = policy.generate
            if rollout is not None:
                self.pipeline = RolloutPipeline(cfg, policy, rollout, train_data, sampler, self.train_sampling)
                generate = lambda prompts, sampling: self.pipeline.generate(prompts, sampling).result()  # noqa: E731
            self.collector = RolloutCollector(
                cfg, generate, reward, train_data, sampler, self.train_sampling,
                needs_baseline=algorithm_needs(cfg).baseline, pad_id=pad_id)
        self.perf = StepPerf(cfg, models)  # perf/*: tokens/s per phase, model FLOPs, MFU
        kr = algo.kl_in_reward
        self.kl_in_reward = KL_ESTIMATORS.get(kr.estimator) if kr.enable else None
        self.kl_ctrl = (AdaptiveKLController(kr.coef, kr.target_kl, kr.horizon) if kr.controller == "adaptive"
                        else FixedKLController(kr.coef))
        self.checkpoints = checkpoints
        self.history: list[dict[str, float]] = list(history or [])
        # the memory guard, signals and divergence (a LoRA run's reference is the policy group
        # itself: its memory records are the policy's)
        self.stops = RunStops(cfg, watched={"policy": policy, **({"ref": ref} if ref and ref is not policy else {}),
                                            **({"teacher": teacher} if teacher else {}),
                                            **({"critic": critic} if critic else {}),
                                            **({"rollout": rollout} if rollout else {}),
                                            **reward.groups()},
                              saved=self.roles, writer=self.writer, console=console, checkpoints=checkpoints,
                              models=models)
        self.memory = self.stops.memory
        self.step = 0

    @property
    def start_step(self) -> int:
        """The step a resumed run continues after (0 for a new run)."""
        return self.stops.start_step

    def fit(self) -> list[dict[str, float]]:
        with SIGNALS.deferred(), self.watchdog():  # SIGINT/SIGTERM: stop at the next safe point (trainer/signals.py)
            try:
                return self._fit()
            except Interrupted as e:
                if not SIGNALS.stopped_at_once:  # stopped at a safe point: its message is complete
                    raise
                raise Interrupted(f"{e}; {self.stops.resume_text()}", e.signum) from None

    def watchdog(self):
        """The hang watchdog over the roles' processes (fitrl/trainer/watchdog.py); nothing when off."""
        t = self.cfg.trainer
        if not t.hang_timeout_s and not any(t.hang_timeouts.values()):
            return contextlib.nullcontext()
        groups = [self.policy.group] + [h.group for h in (self.ref, self.teacher, self.critic)
                                        if h is not None and h is not self.policy]
        groups += [self.pipeline.rollout.group] if self.pipeline is not None else []
        groups += [h.group for h in self.reward.groups().values()]  # reward models', judges' ranks

        def report(text: str, event: dict) -> str:
            self.console.print(text, highlight=False, markup=False)
            write_hang_file(self.run_dir, text)
            self.writer.write({"step": self.step, **event})
            return self.stops.resume_text()
        return HangWatchdog(lambda phase: t.hang_timeouts.get(phase, t.hang_timeout_s) if phase else 0.0,
                            lambda timeout: [r for g in groups for r in g.health(timeout)], report=report)

    def _fit(self) -> list[dict[str, float]]:
        t = self.cfg.trainer
        if t.val_only or (t.val_before_train and self.start_step == 0):
            with self.stops.stoppable():
                self.validate(step=self.start_step)
            self.stops.safe_point(self.start_step, step_done=True, state=None)
        if t.val_only:
            return self.history
        self.prompt_log.keep_through(self.start_step)  # (a resume draws the later steps' prompts again)
        with make_progress(self.console, t.progress_bar) as progress:
            task = progress.add_task("train", total=t.max_steps, completed=self.start_step)
            for step in range(self.start_step + 1, t.max_steps + 1):
                metrics = self.run_step(step)
                self.record(step, metrics)
                if "console" in t.loggers and (step % t.log_freq == 0 or step == t.max_steps):
                    progress.console.print(format_step_line(step, metrics), highlight=False)
                # the step is complete: judged for divergence before any save; a crossing or a
                # signal noted where nothing could stop (update, validation) stops here
                self.stops.safe_point(step, step_done=True, state=self.state_dict(step), metrics=self.history[-1],
                                      judge=True)
                if step != t.max_steps:
                    self.maybe_save(step, metrics)
                progress.advance(task)
        final = {}
        if self.val_data is not None and t.max_steps:
            with self.stops.stoppable():
                final = self.validate(step=t.max_steps)
            self.stops.safe_point(t.max_steps, step_done=True, state=self.state_dict(t.max_steps),
                                  metrics=self.history[-1] if self.history else {})
        if t.max_steps > self.start_step:
            self.maybe_save(t.max_steps, {**self.history[-1], **final} if self.history else final)
        return self.history

    def run_step(self, step: int) -> dict[str, float]:
        """One RL step, its validation when due, and its memory. A guard crossing in a read-only
        phase abandons the step (the run ends here, checkpointed as the previous step)."""
        self.step = step  # (the step a hang or a stop is recorded at)
        at_start = self.state_dict(step - 1)
        with self.stops.stoppable():
            metrics = self.train_step(step)
        self.stops.safe_point(step, step_done=False, state=at_start)  # a stop here abandons the step
        val_freq = self.cfg.trainer.val_freq
        if val_freq and step % val_freq == 0 and step != self.cfg.trainer.max_steps:
            with self.stops.stoppable():  # a stop skips the validation; the step is kept
                metrics.update(self.validate(step))
        mem, events = self.memory.end_step(step)
        metrics.update(mem)
        for event in events:  # leak warnings, kept beside the step they were raised at
            self.writer.write(event)
        return metrics

    def record(self, step: int, metrics: dict[str, float]) -> None:
        # metrics first: a checkpoint of step k implies metrics.jsonl holds step k
        self.writer.write({"step": step, **metrics})
        # per-process/phase memory stays in metrics.jsonl only: with many ranks it is most of a
        # step's keys, and the history lives as long as the run
        self.history.append({k: v for k, v in metrics.items() if not (k.startswith("mem/") and k.count("/") > 1)})

    # ------------------------------------------------------------------ checkpoints

    def roles(self) -> dict[str, RoleHandle]:
        """The roles whose state changes (the reference is frozen and rebuilt from its path)."""
        return {"actor": self.policy, **({"critic": self.critic} if self.critic is not None else {})}

    def maybe_save(self, step: int, metrics: dict[str, float]) -> None:
        # never replace good checkpoints by weights that may be diverging
        if self.checkpoints is not None and self.checkpoints.due(step) and self.stops.may_save(step):
            with PhaseTimer().phase("checkpoint_save", guarded=False):
                self.checkpoints.save(step, self.roles(), self.state_dict(step), metrics)

    def state_dict(self, step: int) -> dict:
        """The driver's part of a checkpoint (RNG states are added by the manager)."""
        sampler = None
        if self.collector is not None:  # (with generations in flight: the state before their draws)
            sampler = self.pipeline.sampler_state(step) if self.pipeline else self.collector.sampler.state_dict()
        return {"step": step, "sampler": sampler, "kl_coef": self.kl_ctrl.value}

    def restore(self, point: Checkpoint) -> None:
        """Continue after ``point``: roles' weights, optimizers, schedulers, RNGs; data position;
        KL coefficient. With ``trainer.val_only`` only the weights are loaded."""
        state = self.checkpoints.restore(point, self.roles(), weights_only=self.cfg.trainer.val_only)
        self.stops.start_step = point.step
        if state is None:
            return
        self.writer.resumed_at(point.step)  # the trackers continue their runs
        if self.collector is not None and state["sampler"] is not None:
            self.collector.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = float(state["kl_coef"])

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        algo = self.cfg.algorithm
        first = self.generated_ahead(step, timer) if self.pipeline is not None else None
        batch, stats = self.collector.collect(step, timer, first)           # (B*n, P+R), scored
        self.writer.add_samples(step, "train", batch)                       # every trainer.log_samples_freq
        source = self.cfg.old_logprob_source  # "update": the update's own forward gives them (no pass)
        if source != "update":
            with timer.phase("old_logprob"):
                if source == "pass":
                    batch.update(self.policy.compute_logprob(batch))
                else:
                    batch.update(old_logprobs=batch["rollout_logprobs"])
        if self.ref is not None:
            with timer.phase("ref"):
                batch.update(self.ref.compute_ref_logprob(batch))
        # this step's distillation weight (algorithm.distill.decay_steps: 0 from some step on, RL alone)
        distill_weight = algo.distill.weight_at(step) if self.teacher is not None else 0.0
        if distill_weight > 0:  # the teacher's log-prob of every sampled token (and top-k): the distillation signal
            with timer.phase("teacher_logprob"):
                batch.update(self.teacher.compute_teacher_logprob(batch))
        if self.critic is not None:
            with timer.phase("values"):
                batch.update(self.critic.compute_values(batch))
        metrics: dict[str, float] = {}
        with timer.phase("advantage"):
            mask = batch["response_mask"].float()
            token_rewards = scores_to_token_rewards(batch["scores"], mask)
            if self.kl_in_reward is not None:
                token_rewards, kl_metrics = self.apply_kl_penalty(batch, token_rewards, mask)
                metrics.update(kl_metrics)
            advantages, returns = compute_advantages(
                algo.adv_estimator, token_rewards=token_rewards, response_mask=mask,
                group_index=group_index(batch["uid"]), values=batch.tensors.get("values"),
                baseline_scores=batch.tensors.get("baseline_scores"), gamma=algo.gamma, lam=algo.lam,
                norm_adv_by_std=algo.norm_adv_by_std, eps=1e-6)
            batch.update(token_rewards=token_rewards, advantages=advantages, returns=returns)
        if self.critic is not None:
            with timer.phase("critic_update"):
                metrics.update(self.critic.update(batch))
        if step > self.cfg.critic.warmup_steps or self.critic is None:
            with timer.phase("update"):
                metrics.update(self.policy.update(batch, **({"distill_weight": distill_weight}
                                                            if self.teacher is not None else {})))
        if self.pipeline is not None:
            with timer.phase("weight_sync"):  # the next generations sample from the updated policy
                self.pipeline.send_weights(step)
            metrics.update(self.pipeline.send_metrics())
            metrics.update(self.pipeline.staleness(step, batch))
            metrics.update(self.pipeline.worker_idle())
        self.prompt_log.write(step, stats.rows, batch)
        metrics.update(self.step_metrics(step, batch, mask, stats))
        metrics.update(timer.metrics())
        # the prompt copies the passes skipped: the driver's and, under Ray, every rank's
        groups = [h.group for h in self.memory.roles.values()] if self.memory.remote else []
        metrics.update(self.perf.metrics(batch, stats.generated, timer.times, skipped_prompts(groups)))
        metrics.update(host_memory())
        return metrics

    def generated_ahead(self, step: int, timer: PhaseTimer) -> FirstRound:
        """Step ``step``'s first round from the rollout workers (fitrl/trainer/pipeline.py); the
        generations of the next ``rollout.lead`` steps are asked for before this step trains."""
        p = self.pipeline
        if p.version < 0:  # this process's first step: the workers get the weights it starts from
            with timer.phase("weight_sync"):
                p.send_weights(step - 1)
        with timer.phase("data"):
            p.fill(step)
        with timer.phase("rollout"):  # the trainer's wait for the workers
            drawn, rollout = p.take(step)
        with timer.phase("data"):
            p.fill(min(step + p.lead, self.cfg.trainer.max_steps))
        return FirstRound(drawn.prompts, drawn.rows, rollout)

    def apply_kl_penalty(self, batch: Batch, token_rewards: torch.Tensor, mask: torch.Tensor):
        """PPO-style KL in the reward, its coefficient from the (adaptive) controller."""
        beta = self.kl_ctrl.value
        rewards, seq_kl = kl_penalized_rewards(token_rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                               self.kl_in_reward, beta)
        self.kl_ctrl.update(seq_kl, n_steps=len(batch))
        return rewards, {"kl_in_reward/kl": seq_kl, "kl_in_reward/coef": beta}

    def step_metrics(self, step: int, batch: Batch, mask: torch.Tensor, stats) -> dict[str, float]:
        components = batch.named(REWARD_COMPONENTS)
        lengths, truncated = response_stats(batch)
        m = sequence_metrics(batch["scores"], components, lengths, truncated, prefix="")
        if "response_text" in batch:  # one answer everywhere is a collapse, whatever the reward says
            m["response/distinct"] = float(len(set(batch["response_text"])))
        m.update(masked_stats("advantage", batch["advantages"], mask))
        m.update(masked_stats("returns", batch["returns"], mask))
        # groups whose samples all scored the same: under a group baseline they carry no signal
        groups = group_index(batch["uid"])
        varied = groups[group_is_informative(batch["scores"], groups)].unique().numel()
        m["adv/zero_variance_groups"] = float(int(groups.max()) + 1 - varied) if len(groups) else 0.0
        d = self.cfg.algorithm.distill
        if "teacher_logprobs" in batch:  # (not once a decaying weight has reached 0)
            m.update(teacher_metrics(batch, mask))
        if self.teacher is not None and d.decay_steps:
            m["distill/weight"] = d.weight_at(step)
        pure_distill = self.teacher is not None and d.weight_at(step) == 1.0  # (the teacher's signal alone trains then)
        if not pure_distill and not bool((batch["advantages"] * mask).any()):
            self.console.print(f"[yellow]step {step}: no learning signal: every advantage is 0 "
                               f"({int(m['adv/zero_variance_groups'])} of {int(groups.max()) + 1} groups scored "
                               f"alike); the update only moves the weights by its other terms[/]")
        if "values" in batch:
            m.update(masked_stats("critic/values", batch["values"], mask))
        if self.cfg.old_logprob_source == "pass":  # ("update": the policy's update reports them)
            # rollout vs trainer log-probs of the same weights: large values mean the two engines
            # disagree (precision, padding, kernels); the TIS weights are the loss's own
            rc = self.cfg.algorithm.rollout_correction
            m.update(mismatch_metrics(batch["old_logprobs"], batch["rollout_logprobs"], mask,
                                      level=None if rc.mode == "off" else rc.mode, cap=rc.cap))
        m.update(stats.metrics)  # reward timeouts / errors / degenerate answers
        m["sampling/rounds"] = float(stats.rounds)
        m["sampling/groups_dropped"] = float(stats.groups_dropped)
        m["sampling/groups_kept"] = float(stats.groups_kept)
        m["data/epoch"] = float(self.collector.sampler.epoch)
        return m

    def validate(self, step: int) -> dict[str, float]:
        if self.val_data is None:
            return {}
        with PhaseTimer().phase("validation"):
            return self._validate(step)

    def _validate(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        scores, comps, lengths, truncated = [], [], [], []
        health: dict[str, float] = {}
        splits = ValidationSplits.from_config(self.cfg)  # by source, @n (fitrl/trainer/validation.py)
        indices = list(range(len(self.val_data)))
        for i in range(0, len(indices), self.cfg.data.val_batch_size):
            prompts = self.val_data.batch(indices[i:i + self.cfg.data.val_batch_size], f"val{step}.{i}")
            out = self.policy.generate(prompts, self.val_sampling)
            scored = self.reward.score_batch(out)
            self.writer.add_samples(step, "val", out, scored)  # generations.jsonl, tracker tables
            for k, v in scored.health.items():
                health[k] = health.get(k, 0.0) + v
            length, trunc = response_stats(out)
            scores.append(scored.scores); comps.append(scored.components); lengths.append(length)
            truncated.append(trunc)
            splits.add(out, scored)
        names = list(dict.fromkeys(k for c in comps for k in c))  # (a batch without one scores it 0)
        m = sequence_metrics(torch.cat(scores), {k: torch.cat([c.get(k, torch.zeros(len(s))) for c, s in
                                                               zip(comps, scores)]) for k in names},
                             torch.cat(lengths), torch.cat(truncated), prefix="val/")
        m.update({f"val/{k}": v for k, v in health.items()})
        m.update(splits.metrics(prefix="val/"))
        m["val/time"] = time.perf_counter() - start
        self.writer.write({"step": step, **m})
        parts = ", ".join(f"{k} {m[f'val/reward/{k}']:.3f}" for k in names)
        self.console.print(f"validation @ step {step}: reward {m['val/reward/mean']:.3f} over "
                           f"{len(self.val_data)} prompts ({parts}){validation_summary(m, splits.n)}", highlight=False)
        return m

    def close(self) -> None:
        self.writer.close()
