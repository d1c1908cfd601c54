"""Where EasyR1 puts the KL, in each of its layouts: the rules of :mod:`fitrl.config.import_maps`
whose translation depends on it.

EasyR1 today (``trainer/ray_trainer.py``) puts the KL nowhere with ``algorithm.disable_kl`` (no
reference model), in the actor's loss with ``algorithm.use_kl_loss``, else in the reward
(``apply_kl_penalty``: ``algorithm.kl_coef`` under the ``kl_type`` controller), one coefficient and
one estimator name (``kl_penalty``) for either. EasyR1 0.2 (its first releases, 0.2.0.dev, until March 2025, before
v0.3.0) held the switch under the actor: ``worker.actor.use_kl_loss`` (on by default), the loss
with its own ``kl_loss_coef`` and ``kl_loss_type``, and ``algorithm.kl_coef`` / ``kl_penalty`` for
the reward's KL when the loss has none (fitrl/config/import_defaults.py holds both layers).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fitrl.config.import_rules import TRANSLATED, Rule, is_true, kl_estimator

V02_SWITCH = "worker.actor.use_kl_loss"
"""EasyR1 0.2's switch (its defaults layer sets it, so a source in that layout always has it)."""


def easyr1_kl_mode(src: dict) -> str:
    """``off``, ``loss`` (the KL in the actor's loss, algorithm's coefficient), ``actor`` (EasyR1
    0.2's loss KL, worker.actor's coefficient and estimator) or ``reward``."""
    if V02_SWITCH in src:
        return "actor" if is_true(src[V02_SWITCH]) else "reward"
    if is_true(src.get("algorithm.disable_kl", False)):
        return "off"
    return "loss" if is_true(src.get("algorithm.use_kl_loss", False)) else "reward"


def _in_loss_or_reward(src: dict) -> list[tuple[str, Any]]:
    mode = easyr1_kl_mode(src)
    if mode == "off":
        return []  # (disable_kl says so)
    return [("algorithm.use_kl_loss", mode in ("loss", "actor")), ("algorithm.kl_in_reward.enable", mode == "reward")]


IN_REWARD = "EasyR1 subtracts the KL from the reward when it is not in the loss"


def easyr1_use_kl_loss() -> Rule:
    """``algorithm.use_kl_loss``: the KL in the actor's loss, or (false) in the reward."""
    return Rule(None, choose=lambda v: Rule(lambda v, src: _in_loss_or_reward(src), TRANSLATED, "" if is_true(v) else
                                            f"{IN_REWARD} (unless algorithm.disable_kl)"))


def easyr1_disable_kl() -> Rule:
    def choose(v: Any) -> Rule:
        if not is_true(v):
            return Rule(None, TRANSLATED, "the KL is in the loss or the reward (algorithm.use_kl_loss)")
        return Rule(lambda v, src: [("algorithm.use_kl_loss", False), ("algorithm.kl_in_reward.enable", False)],
                    TRANSLATED, "no KL, no reference model")
    return Rule(None, choose=choose)


def easyr1_kl(loss_key: Optional[str], reward_key: str, convert: Callable[[Any], Any] = lambda v: v,
              why: str = "") -> Rule:
    """An ``algorithm.kl_*`` setting: to ``loss_key`` or ``reward_key`` as :func:`easyr1_kl_mode`
    says (in EasyR1 0.2 the loss takes worker.actor's, so these are the reward's only)."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        mode = easyr1_kl_mode(src)
        key = {"loss": loss_key, "reward": reward_key}.get(mode)
        return [(key, convert(v))] if key else []
    return Rule(setter, TRANSLATED, why)


def easyr1_kl_penalty() -> Rule:
    """``algorithm.kl_penalty``: the estimator of the loss's or the reward's KL."""
    def choose(v: Any) -> Rule:
        loss, status, why_loss = kl_estimator(True, "algorithm.kl_penalty")(v)
        reward, _, why_reward = kl_estimator(False, "algorithm.kl_penalty")(v)
        why = why_loss if loss == reward else f"in a loss: {why_loss}; in the reward: {reward}"
        why = why or "the estimator of the loss's or the reward's KL, as EasyR1 places it"
        def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
            mode = easyr1_kl_mode(src)
            return {"loss": [("algorithm.kl_estimator", loss)],
                    "reward": [("algorithm.kl_in_reward.estimator", reward)]}.get(mode, [])
        return Rule(setter, status, why)
    return Rule(None, choose=choose)


# ----------------------------------------------------------------- EasyR1 0.2: under worker.actor

def v02_use_kl_loss() -> Rule:
    """``worker.actor.use_kl_loss``: the loss's KL, or (false) the reward's (0.2 always builds the
    reference model, so the reward's KL is there even at ``algorithm.kl_coef=0``)."""
    return Rule(None, choose=lambda v: Rule(lambda v, src: _in_loss_or_reward(src), TRANSLATED, "" if is_true(v) else
                                            f"{IN_REWARD} (algorithm.kl_coef, algorithm.kl_penalty)"))


def v02_loss_kl(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Rule:
    """``worker.actor.kl_loss_coef``: the loss's coefficient, read only when the KL is in the loss."""
    return Rule(lambda v, src: [(key, convert(v))] if easyr1_kl_mode(src) == "actor" else [], TRANSLATED,
                "" if key != "algorithm.kl_coef" else "read by EasyR1 0.2 only with worker.actor.use_kl_loss")


def v02_kl_loss_type() -> Rule:
    """``worker.actor.kl_loss_type``: the loss's estimator."""
    def choose(v: Any) -> Rule:
        name, status, why = kl_estimator(True, "worker.actor.kl_loss_type")(v)
        return Rule(v02_loss_kl("algorithm.kl_estimator", lambda _: name).set, status, why)
    return Rule(None, choose=choose)


KL_COEF_WHY = ("the loss's or the reward's coefficient, as EasyR1 places the KL (algorithm.use_kl_loss); EasyR1 0.2's "
               "loss takes worker.actor.kl_loss_coef instead")
