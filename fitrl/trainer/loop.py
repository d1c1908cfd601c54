"""The RL loop as visible dataflow (DESIGN §2). Each phase is one timed call on a role.

The driver never assumes one process: roles are reached through :class:`RoleHandle`, data
moves as :class:`Batch`, and everything the driver computes itself (rewards, advantages) is
cheap per-sequence math.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console

from fitrl.algo.advantages import ADVANTAGE_ESTIMATORS
from fitrl.config.schema import FitrlConfig
from fitrl.data.batch import Batch
from fitrl.data.dataset import PromptDataset, PromptSampler
from fitrl.rewards.registry import RewardScorer
from fitrl.rollout.hf import Sampling
from fitrl.telemetry.memory import gpu_memory, host_memory
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.logging import MetricsWriter, format_step_line, make_progress
from fitrl.workers.group import RoleHandle


def prompts_batch(dataset: PromptDataset, indices: list[int], step: int) -> Batch:
    rows = [dataset[i] for i in indices]
    return Batch(fields={
        "prompt_ids": [r["prompt_ids"] for r in rows],
        "answer": [r["answer"] for r in rows],
        "source": [r["source"] for r in rows],
        # one uid per prompt draw: the n samples of a prompt form one GRPO group
        "uid": [f"{step}-{j}" for j in range(len(rows))],
    })


def group_index(uids: list[str]) -> torch.Tensor:
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)


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


class RLTrainer:
    def __init__(self, cfg: FitrlConfig, *, policy: RoleHandle, ref: Optional[RoleHandle],
                 train_data: Optional[PromptDataset], val_data: Optional[PromptDataset],
                 reward: RewardScorer, run_dir: Path, console: Console):
        self.cfg, self.policy, self.ref = cfg, policy, ref
        self.train_data, self.val_data, self.reward = train_data, val_data, reward
        self.run_dir, self.console = run_dir, console
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        self.advantage_fn = ADVANTAGE_ESTIMATORS.get(cfg.algorithm.adv_estimator)
        self.sampler = (PromptSampler(len(train_data), cfg.data.rollout_batch_size, cfg.data.shuffle,
                                      cfg.trainer.seed) if train_data is not None else None)
        r = cfg.rollout
        self.train_sampling = Sampling(r.temperature, r.top_p, r.top_k, r.n, r.max_response_length, r.ignore_eos)
        v = r.val
        self.val_sampling = Sampling(v.temperature, v.top_p, v.top_k, v.n, r.max_response_length)
        self.history: list[dict[str, float]] = []

    def fit(self) -> list[dict[str, float]]:
        t = self.cfg.trainer
        if t.val_only or t.val_before_train:
            self.validate(step=0)
        if t.val_only:
            return self.history
        with make_progress(self.console, t.progress_bar) as progress:
            task = progress.add_task("train", total=t.max_steps)
            for step in range(1, t.max_steps + 1):
                metrics = self.train_step(step)
                if t.val_freq and step % t.val_freq == 0 and step != t.max_steps:
                    metrics.update(self.validate(step))
                self.writer.write({"step": step, **metrics})
                self.history.append(metrics)
                if step % t.log_freq == 0 or step == t.max_steps:
                    progress.console.print(format_step_line(step, metrics), highlight=False)
                progress.advance(task)
        if self.val_data is not None and t.max_steps:
            self.validate(step=t.max_steps)
        return self.history

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        algo = self.cfg.algorithm
        with timer.phase("data"):
            prompts = prompts_batch(self.train_data, self.sampler.next_indices(), step)
        with timer.phase("rollout"):
            batch = self.policy.generate(prompts, self.train_sampling)            # (B*n, P+R)
        with timer.phase("reward"):
            scores, components = self.reward.score(batch["response_text"], batch["answer"], batch["source"])
        with timer.phase("old_logprob"):
            if algo.recompute_old_logprob:
                batch.update(self.policy.compute_logprob(batch))
            else:
                batch.update(old_logprobs=batch["rollout_logprobs"])
        if self.ref is not None:
            with timer.phase("ref"):
                batch.update(self.ref.compute_ref_logprob(batch))
        with timer.phase("advantage"):
            mask = batch["response_mask"].float()
            advantages, returns = self.advantage_fn(
                scores, mask, group_index(batch["uid"]), norm_by_std=algo.norm_adv_by_std)
            batch.update(advantages=advantages, returns=returns)
        with timer.phase("update"):
            metrics = self.policy.update(batch)
        lengths, truncated = response_stats(batch)
        metrics.update(sequence_metrics(scores, components, lengths, truncated, prefix=""))
        metrics.update(self._logprob_metrics(batch, mask))
        metrics.update(timer.metrics())
        metrics.update(host_memory())
        metrics.update(gpu_memory())
        metrics["data/epoch"] = float(self.sampler.epoch)
        return metrics

    def _logprob_metrics(self, batch: Batch, mask: torch.Tensor) -> dict[str, float]:
        m = {"advantage/mean": ((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)).item()}
        if "old_logprobs" in batch and self.cfg.algorithm.recompute_old_logprob:
            # rollout vs trainer log-probs of the same weights: large values mean the two
            # engines disagree (precision, padding, kernels) and the importance ratio is biased
            diff = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * mask
            m["rollout/logprob_diff_mean"] = (diff.sum() / mask.sum().clamp(min=1)).item()
        return m

    def validate(self, step: int) -> dict[str, float]:
        if self.val_data is None:
            return {}
        start = time.perf_counter()
        scores, comps, lengths, truncated = [], [], [], []
        indices = list(range(len(self.val_data)))
        for i in range(0, len(indices), self.cfg.data.val_batch_size):
            prompts = prompts_batch(self.val_data, indices[i:i + self.cfg.data.val_batch_size], step)
            out = self.policy.generate(prompts, self.val_sampling)
            s, c = self.reward.score(out["response_text"], out["answer"], out["source"])
            length, trunc = response_stats(out)
            scores.append(s); comps.append(c); lengths.append(length); truncated.append(trunc)
        m = sequence_metrics(torch.cat(scores), {k: torch.cat([c[k] for c in comps]) for k in comps[0]},
                             torch.cat(lengths), torch.cat(truncated), prefix="val/")
        m["val/time"] = time.perf_counter() - start
        self.writer.write({"step": step, **m})
        parts = ", ".join(f"{k[11:]} {v:.3f}" for k, v in m.items()
                          if k.startswith("val/reward/") and k[11:] not in ("mean", "std", "max"))
        self.console.print(f"validation @ step {step}: reward {m['val/reward/mean']:.3f} over "
                           f"{len(self.val_data)} prompts ({parts})", highlight=False)
        return m

    def close(self) -> None:
        self.writer.close()
