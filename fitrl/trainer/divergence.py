"""Has the run diverged? A judge of each step's metrics (``trainer.divergence.*``).

Hard signals stop the run at the step they appear in: a NaN or infinite reward, advantage,
loss, entropy or gradient norm (every optimizer step of the RL step had a non-finite gradient
and was skipped), or trained weights holding NaN/inf after the update (``actor/weights_nonfinite``,
counted on the ranks). Non-finite logits during generation are caught where they happen (the
rollout engine raises :class:`fitrl.core.errors.Diverged`).

Soft signals stop it once they have lasted ``patience`` consecutive steps:

- *saturated*: entropy at ~log(vocabulary) (uniform) and a zero gradient norm although some
  advantages are non-zero. A random-initialised model also sits at log(vocabulary), but it gets
  gradients; a saturated one (e.g. after lr=1e6: weights ~1e6, logits that no longer depend on
  them) has a loss of 0 and a gradient of 0 whatever the rewards say;
- *collapsed*: entropy ~0 with a zero gradient norm: every sample of a prompt is the same, so
  every group's advantages are 0 and nothing is left to learn from;
- KL to the reference or ``|reward/mean|`` beyond their bounds.

While a soft signal is pending (:attr:`DivergenceJudge.pending`) the trainer writes no checkpoint,
so a run that then stops has not replaced a good checkpoint by a diverged one.

The judge is pure: metric dicts in, a reason out (tests/test_divergence.py feeds it hand-made
steps).
"""

from __future__ import annotations

import math
from typing import Optional

from fitrl.config.run import DivergenceConfig
from fitrl.models.shape import ModelShape

# (metric, what it is): a NaN or infinity in any of them stops the run at once. Ordered by
# cause: a broken reward makes every later number NaN, so the first one found is named.
NONFINITE = [
    ("reward/mean", "the mean reward"),
    ("advantage/mean", "the mean advantage"),
    ("critic/vf_loss", "the critic's loss"),
    ("critic/grad_norm", "the critic's gradient norm"),
    ("actor/pg_loss", "the policy loss"),
    ("actor/kl_loss", "the KL loss"),
    ("actor/entropy", "the policy's entropy"),
    ("actor/grad_norm", "the policy's gradient norm (every optimizer step of this RL step had a non-finite "
                        "gradient and was skipped)"),
]
NONZERO_ADVANTAGE = 1e-6  # below this every advantage counts as 0 (GRPO divides by std + 1e-6)


def hard_signal(m: dict[str, float]) -> Optional[str]:
    """What makes this step's metrics non-finite, or None."""
    for key, what in NONFINITE:
        value = m.get(key)
        if value is not None and not math.isfinite(value):
            return f"{what} is {value} ({key})"
    bad = m.get("actor/weights_nonfinite") or 0
    if bad:
        return f"{int(bad)} trained weight tensor(s) hold NaN or infinity after the update (actor/weights_nonfinite)"
    return None


def soft_signals(m: dict[str, float], cfg: DivergenceConfig, vocab_size: Optional[int]) -> dict[str, str]:
    """The soft signals this step shows: ``{name: what was seen}``."""
    out = {}
    entropy, grad = m.get("actor/entropy"), m.get("actor/grad_norm")
    if entropy is not None and grad is not None and grad <= cfg.zero_grad_norm:
        advantage = max(abs(m.get("advantage/max", 0.0)), abs(m.get("advantage/min", 0.0)))
        if vocab_size and vocab_size > 1 and advantage > NONZERO_ADVANTAGE \
                and entropy >= cfg.uniform_entropy_fraction * math.log(vocab_size):
            out["saturated"] = (f"the policy is saturated: entropy {entropy:.3f} nats/token, "
                                f"{entropy / math.log(vocab_size):.1%} of log(vocabulary {vocab_size}) (uniform), "
                                f"and gradient norm {grad:.1e} although advantages reach {advantage:.2f}")
        elif entropy <= cfg.min_entropy:
            out["collapsed"] = (f"the policy has collapsed: entropy {entropy:.1e} nats/token and gradient norm "
                                f"{grad:.1e} (every sample of a prompt the same: nothing left to learn from)")
    if cfg.max_kl:
        kl = m.get("actor/kl_loss")
        if kl is None and "kl_in_reward/kl" in m:  # per response, in the reward: per token
            kl = m["kl_in_reward/kl"] / max(m.get("response/length_mean", 1.0), 1.0)
        if kl is not None and kl > cfg.max_kl:
            out["kl"] = f"the KL to the reference is {kl:.3g} nats/token, over trainer.divergence.max_kl={cfg.max_kl:g}"
    reward = m.get("reward/mean")
    if cfg.max_abs_reward and reward is not None and abs(reward) > cfg.max_abs_reward:
        out["reward"] = (f"the mean reward is {reward:.3g}, beyond trainer.divergence.max_abs_reward="
                         f"{cfg.max_abs_reward:g}")
    return out


class DivergenceJudge:
    """Feed it every step's metrics in order; it answers with the reason the run has diverged."""

    def __init__(self, cfg: DivergenceConfig, vocab_size: Optional[int] = None):
        self.cfg, self.vocab_size = cfg, vocab_size
        self.streaks: dict[str, int] = {}  # soft signal -> consecutive steps it has been seen
        self.seen: dict[str, str] = {}     # soft signal -> what the latest step showed
        self.steps_since_onset = 0         # when it fires: 1 + how many steps before this one it began

    def observe(self, metrics: dict[str, float]) -> Optional[str]:
        """The reason to stop after this step, or None."""
        if not self.cfg.enable:
            return None
        hard = hard_signal(metrics)
        if hard:
            self.steps_since_onset = 1
            return hard
        self.seen = soft_signals(metrics, self.cfg, self.vocab_size)
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in self.seen}  # a gap resets a streak
        for name, text in self.seen.items():
            if self.streaks[name] >= self.cfg.patience:
                self.steps_since_onset = self.streaks[name]
                return f"{text}, for {self.streaks[name]} consecutive steps"
        return None

    @property
    def pending(self) -> Optional[str]:
        """A soft signal seen at the latest step that has not yet lasted ``patience`` steps."""
        if not self.seen:
            return None
        name, text = next(iter(self.seen.items()))
        return f"{text} (step {self.streaks[name]} of trainer.divergence.patience={self.cfg.patience})"


def vocab_size(model_dir: str) -> Optional[int]:
    """The output vocabulary of a model directory's ``config.json`` (the text model's, for a
    vision-language one); None when it cannot be read (the saturation signal is then off)."""
    try:
        value = ModelShape.from_path(model_dir, strict=False).vocab
        return int(value) if value else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None
