"""The ``algorithm`` and ``reward`` sections: the estimator and losses, KL, DAPO's filters and
shaping, rollout correction, on-policy distillation, and the reward function. Field docstrings are what ``fitrl config --doc`` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from fitrl.core.errors import ConfigError
from fitrl.config.reward_sources import RewardSourceConfig, check_sources

@dataclass
class KLRewardConfig:
    enable: bool = False
    """Subtract ``coef * KL(policy || reference)`` from every response token's reward (PPO-style); builds a reference model."""
    estimator: str = "k1"
    """Per-token KL estimator used in the reward (``k1``, ``k2``, ``k3``, ``abs``, ``mse``)."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """``fixed`` keeps ``coef``; ``adaptive`` steers it towards ``target_kl`` (Ziegler et al. 2019)."""
    coef: float = 0.001
    """KL coefficient (the initial one for the adaptive controller)."""
    target_kl: float = 0.1
    """Adaptive controller: target mean KL per sequence."""
    horizon: int = 10000
    """Adaptive controller: sequences over which the coefficient adapts."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose samples all scored the same (no advantage signal) and draw more prompts."""
    metric: str = "score"
    """What must vary within a group: ``score`` (the total reward) or a reward component name (e.g. ``exact``)."""
    max_num_gen_batches: int = 10
    """Generation rounds per step at most (including the first); 0 means no bound."""
    on_exhausted: Literal["continue", "stop"] = "continue"
    """When the bound is hit with a partial batch: ``continue`` with what was kept, or ``stop`` the run with a message."""


@dataclass
class OverlongConfig:
    enable: bool = False
    """DAPO soft overlong punishment: responses in the last ``buffer_length`` tokens before ``rollout.max_response_length`` lose reward linearly."""
    buffer_length: int = 4
    """Length of the penalty ramp in tokens."""
    penalty_factor: float = 1.0
    """Penalty at exactly ``rollout.max_response_length`` tokens."""


@dataclass
class RolloutCorrectionConfig:
    mode: Literal["off", "token", "sequence"] = "off"
    """Truncated importance sampling (TIS) for a rollout engine whose log-probs differ from the trainer's (other kernels or precision, e.g. vLLM): the policy loss's advantages are multiplied by ``min(pi_trainer / pi_rollout, cap)`` of each sampled ``token``, or of each ``sequence`` (the product over its tokens, on all of them); ``off`` trains as if the two agreed. Needs ``algorithm.recompute_old_logprob``. Logged as ``rollout/is_weight_mean`` and ``rollout/is_clipped_frac``."""
    cap: float = 2.0
    """Upper bound of the importance weight: lower cuts the variance a few far-off tokens bring, at some bias."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cap) and self.cap > 0):
            raise ConfigError(f"algorithm.rollout_correction.cap must be a finite number > 0, got {self.cap}")


@dataclass
class DistillConfig:
    weight: float = 0.0
    """On-policy distillation (docs/algorithms.md): the loss is ``(1 - weight) * policy loss + weight * distillation loss``, the distillation term scored by a teacher (``teacher.model``) on the student's own samples. 0: off, pure RL (no teacher is built); 1: pure distillation (rewards are still computed and logged)."""
    loss: Literal["reverse_kl", "topk_forward_kl"] = "reverse_kl"
    """``reverse_kl``: ``KL(student || teacher)`` on the sampled tokens, ``log pi - log teacher`` as a per-token policy-gradient signal (needs only the teacher's log-prob of each sampled token); ``topk_forward_kl``: ``KL(teacher || student)`` over the teacher's ``top_k`` likeliest tokens per position plus one bucket for the rest (fitrl/algo/distill.py)."""
    top_k: int = 0
    """Tokens per position whose teacher log-probs and ids the teacher's pass keeps (``topk_forward_kl`` needs >= 1, e.g. 20; with ``reverse_kl`` optional, for ``distill/teacher_agreement``). Costs tokens x k x 12 bytes per step; at most the vocabulary size."""
    agg_mode: Optional[str] = None
    """Aggregation of the per-token distillation loss (as ``algorithm.loss_agg_mode``); unset: ``algorithm.loss_agg_mode``'s."""
    solved_score: Optional[float] = None
    """Reward-guided masking: a response whose score is at least this is left to the RL term (not distilled: the teacher cannot pull an answer the reward accepts toward its own mistakes); unset: every response is distilled."""
    decay_steps: int = 0
    """0: ``weight`` holds for the whole run. N > 0: distill, then RL: the weight falls linearly from ``weight`` at step 1 to 0 at step N + 1, and from there the run is RL alone (the teacher's pass is skipped; the teacher stays loaded)."""

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
            raise ConfigError(f"algorithm.distill.weight must be in [0, 1] (0: pure RL, 1: pure distillation), got {w}")
        if isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int) or self.decay_steps < 0:
            raise ConfigError(f"algorithm.distill.decay_steps must be an integer >= 0 (0: a constant weight), "
                              f"got {self.decay_steps!r}")
        if self.top_k < 0:
            raise ConfigError(f"algorithm.distill.top_k must be >= 0 (0: no top-k), got {self.top_k}")
        if self.loss == "topk_forward_kl" and w > 0 and self.top_k < 1:
            raise ConfigError("algorithm.distill.loss=topk_forward_kl needs the teacher's top-k tokens: set "
                              "algorithm.distill.top_k >= 1 (e.g. 20)")

    @property
    def enabled(self) -> bool:
        return self.weight > 0

    def weight_at(self, step: int) -> float:
        """The mixing weight of RL step ``step`` (1-based): ``weight``, or with ``decay_steps`` its
        linear fall to 0 at step ``decay_steps + 1``.

        >>> DistillConfig(weight=1.0, decay_steps=4).weight_at(3)
        0.5
        """
        if not self.decay_steps:
            return float(self.weight)
        return float(self.weight) * max(0.0, 1.0 - (step - 1) / self.decay_steps)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator, from the registry in ``fitrl.algo.advantages`` (e.g. ``grpo``)."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred scores by the group's standard deviation (``drgrpo`` never does)."""
    gamma: float = 1.0
    """Discount for GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda."""
    policy_loss: str = "ppo_clip"
    """Policy loss, from the registry in ``fitrl.algo.losses``."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (Dr.GRPO); denominators are global over the mini-batch."""
    use_kl_loss: bool = False
    """Add ``kl_coef * KL(policy || reference)`` to the loss; builds a reference model."""
    kl_coef: float = 0.001
    """Weight of the KL term when ``use_kl_loss`` is on."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: ``k1``, ``k2``, ``k3`` (low-variance, a.k.a. low_var_kl)."""
    recompute_old_logprob: bool = True
    """Recompute the behaviour log-probs with the actor before the update; off reuses the rollout's."""
    fold_old_logprob: bool = True
    """When the update is one optimizer step on fresh samples (``actor.ppo_epochs`` 1 and ``actor.mini_batch_size`` = ``data.rollout_batch_size``), take the recomputed behaviour log-probs from the update's own forward, detached: the same weights give the same numbers, so the PPO ratio is exactly 1 and the pass before the update (one forward over every sequence, ~18 % of a step) is skipped, as TRL does. Not with ``kl_in_reward``, which needs them before the update. The rollout mismatch metrics come from the update's forward then. ``false`` always runs the pass."""
    kl_in_reward: KLRewardConfig = field(default_factory=KLRewardConfig)
    """KL penalty in the reward (the alternative to ``use_kl_loss``)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling (online filtering of uninformative groups)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong reward shaping."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correction of the rollout engine's log-probs towards the trainer's (truncated importance sampling)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (``teacher.model``), mixed with the policy loss."""

    def __post_init__(self) -> None:
        if self.rollout_correction.mode != "off" and not self.recompute_old_logprob:
            raise ConfigError(f"algorithm.rollout_correction.mode={self.rollout_correction.mode} weighs the rollout "
                              "engine's log-probs against the trainer's, which algorithm.recompute_old_logprob=false "
                              "never computes: set algorithm.recompute_old_logprob=true or "
                              "algorithm.rollout_correction.mode=off")


@dataclass
class RewardConfig:
    function: str = "arith"
    """Reward: a registered name (``arith``) or ``path/to/file.py:function`` / ``package.module:function``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the reward function (weights, options)."""
    num_workers: int = 2
    """Reward worker processes (each ~60-70 MB of host memory). 0 scores in the driver process, where nothing bounds a call's time or contains a crash (a segfault in the function ends the run; the stack printed names the function)."""
    timeout: float = 10.0
    """Wall-clock seconds one reward call may take (one response; the whole batch when ``batched``); past it the worker is killed and replaced and the call scores ``fallback_score``."""
    fallback_score: float = 0.0
    """Score of a call that timed out or raised; counted in ``reward/timeouts`` / ``reward/errors`` and its input logged once."""
    max_error_fraction: float = 0.5
    """Stop the run when more than this fraction of one batch's responses raise (a broken function, not a hard sample); 1.0 never stops. Timeouts do not count."""
    batched: bool = False
    """The function takes lists: ``fn(responses, answers, **kwargs)`` returns one result per response (one call per batch)."""
    correct_key: Optional[str] = None
    """What makes a validation response correct for ``val/accuracy/*@n``: a component's name, or ``score``; unset: the ``accuracy`` component, else ``exact``, else the score."""
    correct_threshold: float = 1.0
    """A response is correct when that value is >= this."""
    sources: dict[str, RewardSourceConfig] = field(default_factory=dict)
    """The reward as a weighted sum of named sources (rule functions, reward models, LLM judges; each logged as ``reward/<name>``); empty: ``function`` is the whole reward. See docs/reward-models.md."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"reward.num_workers must be >= 0, got {self.num_workers}")
        if not self.timeout > 0:
            raise ConfigError(f"reward.timeout must be > 0 seconds, got {self.timeout}")
        if not 0.0 <= self.max_error_fraction <= 1.0:
            raise ConfigError(f"reward.max_error_fraction must be in [0, 1], got {self.max_error_fraction}")
        if not math.isfinite(self.fallback_score):
            raise ConfigError(f"reward.fallback_score must be a finite number, got {self.fallback_score}")
        check_sources(self.sources)
