"""Supervised fine-tuning (``fitrl sft``): the warm start users run before RL.

The same run as ``fitrl train`` (config, data, chat templates, FSDP2 and Ray, LoRA, checkpoints
with exact resume, memory telemetry and guard, trackers, validation by the reward) with one
different step: each prompt's answer column is the target (or, for rows in TRL's ``messages`` and
``prompt``/``completion`` formats, the assistant turns: fitrl/data/supervised.py), and the policy's
update minimises its negative log-likelihood (``PolicyWorker.sft_update``). Its checkpoints export with
``fitrl export`` to a Hugging Face directory that ``fitrl train`` starts from (docs/sft.md).
"""

from __future__ import annotations

from typing import Any

from fitrl.config.roles import OptimConfig
from fitrl.config.schema import FitrlConfig
from fitrl.core.errors import DataError
from fitrl.data.supervised import bad_target, target_lengths
from fitrl.telemetry.memory import host_memory
from fitrl.telemetry.timer import PhaseTimer
from fitrl.trainer.loop import RLTrainer

SFT_LR = 5e-5
"""``fitrl sft``'s learning rate where the config sets none (RL's default, 1e-6, barely moves a
supervised loss). TRL's SFTConfig uses 2e-5, LoRA recipes 1e-4 to 2e-4; 5e-5 is a usual full
fine-tuning rate for real models. Measured on the tiny test model, a ``messages`` file of sums,
30 steps of 8 rows: ``sft/nll`` 6.25 -> 5.78 (2e-5: 6.05; 1e-4: 5.51; 1e-6: unmoved;
tests/test_sft_formats.py)."""

STALL_STEPS = 20
"""Steps after warm-up over which ``sft/nll`` must fall by :data:`STALL_FRACTION`, else a warning
names the learning rate."""
STALL_FRACTION = 0.02


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
    if a.distill.weight:
        changed.append(f"algorithm.distill.weight=0 (was {a.distill.weight:g}: a supervised run trains on its "
                       f"targets, not toward a teacher)")
    cfg.rollout.n = 1
    a.use_kl_loss = a.kl_in_reward.enable = False
    a.distill.weight = 0.0
    if a.adv_estimator == "gae":
        a.adv_estimator = "grpo"
    optim = cfg.actor.optim
    given = getattr(cfg, "given_keys", None)  # (a config built in code: none known, the value decides)
    if ("actor.optim.lr" not in given) if given is not None else optim.lr == OptimConfig.lr:
        changed.append(f"actor.optim.lr={SFT_LR:g} (fitrl sft's default; RL's, {optim.lr:g}, barely moves a "
                       f"supervised loss; set actor.optim.lr to choose)")
        optim.lr = SFT_LR
    return changed


def check_targets(answers: list[Any], sources: list[str], tokenizer: Any, max_length: int,
                  key: str = "answer") -> str | None:
    """Refuse, naming the first, a row whose target has no text (null, empty, a list, NaN); return
    a note on the targets longer than ``max_length`` tokens (cut there, losing their end token),
    None when none is. ``key``: the answer column (``data.answer_key``), for the message."""
    for answer, source in zip(answers, sources):
        why = bad_target(answer)
        if why is not None:
            raise DataError(f"{source}: the answer {key!r} (data.answer_key, the supervised target) {why}: "
                            f"{answer!r:.80}; fix or remove the row")
    lengths = target_lengths(answers, tokenizer)
    over = [n for n in lengths if n > max_length]
    if not over:
        return None
    return (f"{len(over)} of {len(lengths)} supervised targets are longer than rollout.max_response_length="
            f"{max_length} tokens (longest {max(over)}) and are cut there, their end token lost; raise "
            f"rollout.max_response_length to train on them whole")


def stall_warning(nll: list[float], lr: float, steps: int = STALL_STEPS) -> str | None:
    """The warning when the first ``steps`` values of ``sft/nll`` have not fallen by
    :data:`STALL_FRACTION` (the mean of the last three against the first three), else None.

    >>> stall_warning([6.0] * 20, 1e-7) is not None, stall_warning([6.0 - 0.1 * i for i in range(20)], 5e-5)
    (True, None)
    """
    if len(nll) < steps:
        return None
    first, last = sum(nll[:3]) / 3, sum(nll[steps - 3:steps]) / 3
    if first - last >= STALL_FRACTION * abs(first):
        return None
    return (f"warning: the supervised loss has not moved in {steps} steps (sft/nll {first:.4g} -> {last:.4g}, "
            f"{(last - first) / abs(first):+.1%}); the learning rate may be too small: actor.optim.lr={lr:g} "
            f"(fitrl sft's default is {SFT_LR:g})")


class SFTTrainer(RLTrainer):
    """``RLTrainer`` (its validation, checkpoints, stops, logging) with a supervised step; the
    targets checked at start-up, and a warning when the loss has not moved after warm-up."""

    def __init__(self, cfg: FitrlConfig, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        from fitrl.models.loading import load_tokenizer

        rows = [self.train_data[i] for i in range(len(self.train_data))]
        note = check_targets([r["answer"] for r in rows], [r["source"] for r in rows],
                             load_tokenizer(cfg.actor.model), cfg.rollout.max_response_length, key=cfg.data.answer_key)
        if note:
            self.console.print(f"note: {note}", highlight=False, markup=False)
        self.nll: list[float] = []  # this process's steps after warm-up, until the stall check

    def train_step(self, step: int) -> dict[str, float]:
        timer = PhaseTimer()
        prompts = self.train_data.batch(self.collector.sampler.next_indices(), tag=f"s{step}")
        with timer.phase("update"):
            metrics = self.policy.sft_update(prompts)
        if step > self.cfg.actor.optim.warmup_steps and len(self.nll) < STALL_STEPS:
            self.nll.append(metrics["sft/nll"])
            warning = stall_warning(self.nll, self.cfg.actor.optim.lr)
            if warning:
                self.console.print(warning, highlight=False, markup=False)
        metrics.update(timer.metrics())
        metrics["data/epoch"] = float(self.collector.sampler.epoch)
        metrics.update(host_memory())
        return metrics
