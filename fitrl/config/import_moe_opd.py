"""veRL's mixture-of-experts and on-policy distillation keys for :mod:`fitrl.config.import_maps`:
router replay (``router_replay.mode``, ``enable_rollout_routing_replay``), Megatron's router losses
(``override_transformer_config.moe_*``), and the ``distillation`` section (veRL's OPD, its
docs/algo/opd.md), each to fitrl's ``actor.routing_replay``, ``actor.router_aux_loss_coef``,
``algorithm.distill.*`` and ``teacher.model.path`` (docs/algorithms.md), or dropped with why.

The facts, from verl-project/verl at 1dda039b9c6311889a9c9a26040677e1254814f9:
``verl/workers/config/actor.py`` (``RouterReplayConfig``: ``disabled``, ``R2`` records the
trainer's own log-prob pass's routing and replays it in the update, ``R3`` replays the rollout
engine's), ``verl/trainer/config/distillation/distillation.yaml`` (the defaults below) and
``verl/trainer/distillation/losses.py`` (``distillation_ppo_loss``: ``policy + coef x distill``
with task rewards, the distillation loss alone without; the estimators backpropagated, or used as
a per-token reward with ``use_policy_gradient``). EasyR1 (hiyouga/EasyR1 at b44b311b) has neither
router replay nor distillation, and, like veRL's FSDP actor, adds no router load-balancing loss:
:data:`MOE_AUX_OFF`.
"""

from __future__ import annotations

import re
from typing import Any

from fitrl.config.import_rules import APPROXIMATED, TRANSLATED, Rule, drop, engine_name, is_true, to

# ------------------------------------------------------------------------------ mixture of experts

NEEDS_HF = "with rollout.engine=hf, whose rollouts record each token's experts (not translated with vllm)"


def _router_replay(v: Any) -> Rule:
    """veRL's ``router_replay.mode`` (the actor's, its Megatron or VeOmni engine's)."""
    mode = str(v)
    if mode == "disabled":
        return Rule(None, TRANSLATED, "no replay, as fitrl's actor.routing_replay=false")
    if mode == "R3":
        return to("actor.routing_replay", lambda _: True, TRANSLATED,
                  f"every training forward runs each sampled token on the experts the rollout chose; {NEEDS_HF}")
    if mode == "R2":
        return to("actor.routing_replay", lambda _: True, APPROXIMATED,
                  f"veRL's R2 replays its own log-prob pass's routing in the update; fitrl replays the rollout's "
                  f"(R3) in every training forward, so the update routes as the log-prob pass did too; {NEEDS_HF}")
    return drop("not a router replay mode of veRL's (disabled, R2, R3): nothing replayed")


REPLAY_MODES = tuple(f"actor_rollout_ref.actor.{engine}router_replay.mode" for engine in ("", "megatron.", "veomni."))
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"


def router_replay_rules(flat: dict[str, Any]) -> dict[str, Rule]:
    """A replay mode the source sets with an engine fitrl runs as vllm (veRL's own R3 runs on vLLM
    or SGLang): dropped, saying how to replay, rather than a config that does not load."""
    name = flat.get(ROLLOUT_NAME, "vllm")
    if engine_name(name) == "hf":
        return {}
    return {key: drop(f"{ROLLOUT_NAME}={name} runs as fitrl's vllm engine, which does not return the experts it "
                      f"chose; fitrl replays what its hf engine records: give {ROLLOUT_NAME}=hf to replay "
                      f"(actor.routing_replay=true)")
            for key in REPLAY_MODES if str(flat.get(key, "disabled")) in ("R2", "R3")}


MEGATRON_BALANCING = "moe_router_load_balancing_type"
OVERRIDE = "actor_rollout_ref.actor.megatron.override_transformer_config."


def _balancing(v: Any) -> Rule:
    """Megatron's ``moe_router_load_balancing_type``: which load-balancing loss the router adds."""
    kind = str(v).strip("'\"")
    if kind == "none":
        return to("actor.router_aux_loss_coef", lambda _: 0.0, TRANSLATED, "no load-balancing loss")
    if kind == "aux_loss":
        return Rule(None, TRANSLATED, "the Switch-style loss, as transformers' load_balancing_loss_func that fitrl "
                                      "adds (actor.router_aux_loss_coef weighs it)")
    return drop(f"Megatron's {kind} balancing: fitrl adds transformers' load_balancing_loss_func only "
                f"(actor.router_aux_loss_coef weighs it)")


def _aux_coeff(v: Any, src: dict) -> list[tuple[str, Any]]:
    off = str(src.get(OVERRIDE + MEGATRON_BALANCING, "")).strip("'\"") == "none"
    return [] if off else [("actor.router_aux_loss_coef", float(v))]


MOE_AUX_OFF = {
    "verl": "veRL's FSDP actor trains on its policy loss alone (a mixture-of-experts forward there returns no router "
            "logits, so no load-balancing loss); a dense policy ignores the key",
    "easyr1": "EasyR1's actor trains on its policy loss alone (a mixture-of-experts forward there returns no router "
              "logits, so no load-balancing loss); a dense policy ignores the key",
}
"""What the import sets for a source that says nothing about the router's loss (fitrl's unset
``actor.router_aux_loss_coef`` is the model's own, 0.001 for Qwen3-MoE): fitrl/config/importer.py."""
MOE_AUX_KEYS = (OVERRIDE + "moe_aux_loss_coeff", OVERRIDE + MEGATRON_BALANCING)
"""Source keys that say it (the importer's own line is left out then)."""

# ------------------------------------------------------------------------- on-policy distillation

OPD = "distillation."
LOSS = OPD + "distillation_loss."
OPD_DEFAULTS = {OPD + "enabled": False, LOSS + "loss_mode": "k3", LOSS + "topk": 32, LOSS + "use_task_rewards": True,
                LOSS + "distillation_loss_coef": 1.0, LOSS + "use_policy_gradient": False}
"""veRL's ``distillation.yaml`` (the YAML that main_ppo composes, which its dataclass defaults do not override)."""
TOPK_LOSSES = ("forward_kl_topk",)
"""veRL's losses whose signal is the teacher's top-k (fitrl's ``topk_forward_kl``)."""


def _opd(src: dict, key: str) -> Any:
    """The source's ``distillation.enabled`` or ``distillation.distillation_loss.<key>``, else veRL's default."""
    full = OPD + key if key == "enabled" else LOSS + key
    return src.get(full, OPD_DEFAULTS[full])


def distill_loss(src: dict) -> str:
    """fitrl's ``algorithm.distill.loss`` for the source's loss mode and how it trains: the top-k
    forward KL for veRL's ``forward_kl_topk`` and for ``k3`` backpropagated (its gradient on the
    sampled tokens, ``(1 - teacher/pi) grad log pi``, is in expectation the forward KL's); the
    reverse KL's policy-gradient signal for the others."""
    mode, pg = str(_opd(src, "loss_mode")), is_true(_opd(src, "use_policy_gradient"))
    return "topk_forward_kl" if mode in TOPK_LOSSES or (mode in ("k3", "low_var_kl") and not pg) else "reverse_kl"


def _loss_pairs(src: dict) -> list[tuple[str, Any]]:
    loss = distill_loss(src)
    return [("algorithm.distill.loss", loss)] + \
        ([("algorithm.distill.top_k", int(_opd(src, "topk")))] if loss == "topk_forward_kl" else [])


def _enabled(v: Any) -> Rule:
    if not is_true(v):
        return Rule(None, TRANSLATED, "no teacher, as fitrl's algorithm.distill.weight=0")
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        if not is_true(_opd(src, "use_task_rewards")):
            weight = 1.0
        else:
            coef = float(_opd(src, "distillation_loss_coef"))
            if coef < 0:
                raise ValueError(f"distillation_loss_coef={coef} < 0")
            weight = round(coef / (1.0 + coef), 6)
        return [("algorithm.distill.weight", weight)] + ([] if LOSS + "loss_mode" in src else _loss_pairs(src))
    return Rule(setter, APPROXIMATED,
                "with task rewards veRL trains policy + coef x distillation: fitrl's (1 - w) policy + w distillation "
                "at w = coef/(1 + coef) is the same mix at 1/(1 + coef) of the scale (AdamW's steps barely change; "
                "the gradient clip acts on the smaller norm); without, w=1; a loss mode left out is veRL's k3 "
                "backpropagated (see distillation.distillation_loss.loss_mode)")


def _when_enabled(pairs) -> Any:
    return lambda v, src: pairs(src) if is_true(_opd(src, "enabled")) else []


def _loss_mode(v: Any) -> Rule:
    mode = str(v)
    setter = _when_enabled(_loss_pairs)
    if mode in TOPK_LOSSES:
        return Rule(setter, APPROXIMATED, "algorithm.distill.top_k from distillation_loss.topk; fitrl adds one bucket "
                                          "for the teacher's mass outside its top-k (the exact KL of the merged "
                                          "distribution; veRL sums the top-k tokens alone, floored at 0) and "
                                          "backpropagates it (with use_policy_gradient veRL uses it as a reward)")
    if mode in ("k1", "kl"):
        return Rule(setter, TRANSLATED, "(log pi - log teacher) of each sampled token as a policy-gradient signal, "
                                        "veRL's PG OPD (which it requires for k1: use_policy_gradient=true)")
    if mode in ("k2", "mse"):
        return Rule(setter, APPROXIMATED, "backpropagated (use_policy_gradient=false), 0.5 (log pi - log teacher)^2 "
                                          "has reverse_kl's gradient exactly (its logged value is k1's); as a reward "
                                          "veRL weighs grad log pi by k2's value, fitrl by k1's")
    if mode in ("k3", "low_var_kl"):
        return Rule(setter, APPROXIMATED, "backpropagated (use_policy_gradient=false, veRL's default), k3's gradient "
                                          "on the sampled tokens is in expectation the forward KL(teacher || student)'s: "
                                          "fitrl's topk_forward_kl over the teacher's top-k tokens "
                                          "(distillation_loss.topk) plus a bucket for the rest; as a reward, fitrl's "
                                          "reverse_kl (grad log pi weighed by k1's value, not k3's)")
    if mode == "abs":
        return Rule(setter, APPROXIMATED, "|log pi - log teacher|: fitrl's reverse_kl, the signed per-token signal")
    return drop(f"not one of veRL's distillation losses (forward_kl_topk, k1, k2, k3, abs, ...): the run trains "
                f"fitrl's reverse_kl unless you set algorithm.distill.loss")


def _topk(v: Any, src: dict) -> list[tuple[str, Any]]:
    on = is_true(_opd(src, "enabled")) and distill_loss(src) == "topk_forward_kl"
    return [("algorithm.distill.top_k", int(v))] if on else []


def _clamp(what: str) -> Rule:
    return Rule(None, choose=lambda v: Rule(None, TRANSLATED, "no clamp, as fitrl") if v is None else
                drop(f"fitrl does not clamp {what}"))


TEACHER_SERVERS = ("veRL serves its teachers from inference engines of their own (their devices, replicas and "
                   "routing key): fitrl's one teacher scores the rollout with a forward pass on the policy's devices "
                   "(teacher.logprob_micro_batch_size, teacher.fsdp; docs/algorithms.md)")
ONE_TEACHER = ("fitrl distills from one teacher (teacher.model.path): veRL routes each sample to one of several by "
               "distillation.teacher_key")

VERL_MOE_OPD: dict[str, Rule] = {
    # router replay (veRL's RouterReplayConfig; the engine paths of its newer releases)
    **{key: Rule(None, choose=_router_replay) for key in REPLAY_MODES},
    "actor_rollout_ref.actor.router_replay.record_file": drop("fitrl replays each batch's routing from the rollout "
                                                              "that recorded it, never from a file"),
    "actor_rollout_ref.actor.router_replay.replay_file": drop("fitrl replays each batch's routing from the rollout "
                                                              "that recorded it, never from a file"),
    "actor_rollout_ref.ref.router_replay.mode": drop("fitrl's reference forward replays the rollout's routing with the "
                                                     "actor's setting (actor.routing_replay)"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": Rule(
        None, TRANSLATED, "fitrl's hf engine records each sampled token's experts of a mixture-of-experts policy; "
                          "actor.routing_replay (veRL's router_replay.mode=R3) replays them"),
    # Megatron's router losses (override_transformer_config, otherwise dropped with the Megatron backend)
    OVERRIDE + "moe_aux_loss_coeff": Rule(
        _aux_coeff, APPROXIMATED, "the load-balancing loss's weight: fitrl's loss is transformers' "
                                  "load_balancing_loss_func over each sparse layer's router (fitrl/roles/moe.py); "
                                  "nothing is set when moe_router_load_balancing_type=none turns it off"),
    OVERRIDE + MEGATRON_BALANCING: Rule(None, choose=_balancing),
    OVERRIDE + "moe_z_loss_coeff": drop("the router z-loss: fitrl has none (actor.router_aux_loss_coef weighs the "
                                        "load-balancing loss only)"),
    # on-policy distillation (veRL's distillation section; docs/algo/opd.md)
    OPD + "enabled": Rule(None, choose=_enabled),
    LOSS + "loss_mode": Rule(None, choose=_loss_mode),
    LOSS + "topk": Rule(_topk, TRANSLATED, "the teacher's top-k tokens per position, kept for fitrl's topk_forward_kl "
                                           "(veRL's forward_kl_topk, or k3 backpropagated); reverse_kl keeps none"),
    LOSS + "use_task_rewards": Rule(None, TRANSLATED, "read with distillation.enabled (algorithm.distill.weight: "
                                                      "1 without task rewards)"),
    LOSS + "distillation_loss_coef": Rule(None, TRANSLATED, "read with distillation.enabled (algorithm.distill.weight "
                                                            "= coef/(1 + coef) with task rewards)"),
    LOSS + "use_policy_gradient": Rule(None, TRANSLATED, "read with distillation.distillation_loss.loss_mode (how "
                                                         "its signal trains)"),
    LOSS + "loss_max_clamp": _clamp("the per-token distillation loss"),
    LOSS + "log_prob_min_clamp": _clamp("the log-probs of the distillation loss"),
    LOSS + "policy_loss_mode": Rule(None, choose=lambda v: Rule(
        None, TRANSLATED, "fitrl's reverse_kl goes through algorithm.policy_loss with the behaviour log-probs when "
                          "an update takes several optimizer steps (one on fresh samples: ratio 1)")
        if str(v) == "vanilla" else drop(f"veRL supports vanilla only; fitrl's reverse_kl goes through "
                                         f"algorithm.policy_loss")),
    LOSS + "clip_ratio": drop("the clip of veRL's distillation reward: fitrl clips with the policy's "
                              "actor.clip_ratio_low/high (one optimizer step on fresh samples clips nothing)"),
    LOSS + "clip_ratio_low": drop("the clip of veRL's distillation reward: fitrl clips with actor.clip_ratio_low"),
    LOSS + "clip_ratio_high": drop("the clip of veRL's distillation reward: fitrl clips with actor.clip_ratio_high"),
    LOSS + "use_chunked_topk": drop("fitrl's top-k passes always run in chunks of actor.logprob_chunk_size tokens"),
    LOSS + "chunked_topk_chunk_size": drop("fitrl's top-k passes run in chunks of actor.logprob_chunk_size tokens"),
    OPD + "n_gpus_per_node": drop(TEACHER_SERVERS),
    OPD + "nnodes": drop(TEACHER_SERVERS),
    OPD + "teacher_key": drop(ONE_TEACHER),
    OPD + "teacher_models.teacher_model.model_path": to("teacher.model.path"),
}
"""veRL keys of a mixture-of-experts policy and of on-policy distillation."""

VERL_MOE_OPD_PREFIXES: dict[str, Rule] = {
    OPD + "teacher_models.": drop(TEACHER_SERVERS),
    "actor_rollout_ref.teacher.": drop("the teacher server of veRL's GKD recipe (ZeroMQ): fitrl runs its teacher "
                                       "itself: teacher.model.path with algorithm.distill.weight (docs/algorithms.md)"),
}

TEACHER_PATH = re.compile(re.escape(OPD) + r"teacher_models\.([^.]+)\.model_path")


def teacher_path_rules(flat: dict[str, Any]) -> dict[str, Rule]:
    """Each ``distillation.teacher_models.<name>.model_path`` the source sets: fitrl's one teacher
    when it names one (veRL pops the default ``teacher_model`` entry once another is named), else
    dropped: fitrl has no routing among teachers."""
    named = {m.group(1): key for key in flat if (m := TEACHER_PATH.fullmatch(key))}
    used = [n for n in named if n != "teacher_model" or len(named) == 1]
    rules = {}
    for name, key in named.items():
        if name not in used:
            rules[key] = drop("veRL drops the teacher_model entry once other teachers are named")
        elif len(used) > 1:
            rules[key] = drop(f"{ONE_TEACHER}; set teacher.model.path to one of them")
        else:
            rules[key] = to("teacher.model.path")
    return rules
