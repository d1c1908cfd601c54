"""Supervised fine-tuning (``fitrl sft``): the warm start users run before RL.

The same run as ``fitrl train`` (config, data, chat templates, FSDP2 and Ray, LoRA, checkpoints
with exact resume, memory telemetry and guard, trackers, validation by the reward) with one
different step: each prompt's answer column is the target, and the policy's update minimises its
negative log-likelihood (``PolicyWorker.sft_update``). Its checkpoints export with
``fitrl export`` to a Hugging Face directory that ``fitrl train`` starts from (docs/sft.md).
"""

from __future__ import annotations

from fitrl.config.schema import FitrlConfig
from fitrl.telemetry.memory import host_memory
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.loop import RLTrainer


def supervised_config(cfg: FitrlConfig) -> list[str]:
    """Set what a supervised run never uses to off, in place (one target per prompt, no
    reference, no critic): the saved config.yaml and the memory plan then describe the run that
    happens. Returns what changed, for the start-up notes."""
    a, changed = cfg.algorithm, []
    for what, now, off in (("rollout.n", cfg.rollout.n, 1), ("algorithm.use_kl_loss", a.use_kl_loss, False),
                           ("algorithm.kl_in_reward.enable", a.kl_in_reward.enable, False),
                           ("algorithm.adv_estimator", a.adv_estimator, "grpo" if a.adv_estimator == "gae"
                            else a.adv_estimator)):
        if now != off:
            changed.append(f"{what}={off} (was {now}: a supervised run has one target per prompt, no reference "
                           f"and no critic)")
    cfg.rollout.n = 1
    a.use_kl_loss = a.kl_in_reward.enable = False
    if a.adv_estimator == "gae":
        a.adv_estimator = "grpo"
    return changed


class SFTTrainer(RLTrainer):
    """``RLTrainer`` (its validation, checkpoints, stops, logging) with a supervised step."""

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        prompts = self.train_data.batch(self.collector.sampler.next_indices(), tag=f"s{step}")
        with timer.phase("update"):
            metrics = self.policy.sft_update(prompts)
        metrics.update(timer.metrics())
        metrics["data/epoch"] = float(self.collector.sampler.epoch)
        metrics.update(host_memory())
        return metrics
