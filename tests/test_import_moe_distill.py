"""``fitrl import-config`` on veRL's mixture-of-experts and on-policy distillation keys
(fitrl/config/import_moe_opd.py): router replay (``router_replay.mode``,
``enable_rollout_routing_replay``), Megatron's router losses, the ``distillation`` section
(verl-project/verl docs/algo/opd.md), and the router loss a source leaves out (veRL's FSDP actor
and EasyR1 add none). One test per mapped key; the corpus's OPD script
(tests/data/foreign/verl/examples/on_policy_distillation_trainer/) imports, loads and plans in
tests/test_import_corpus.py."""

from __future__ import annotations

import pytest

from fitrl.config import ConfigError, load_config
from fitrl.config.importer import import_config

MODEL = "actor_rollout_ref.model.path=/m"
OVERRIDE = "+actor_rollout_ref.actor.megatron.override_transformer_config."
TEACHER = "distillation.teacher_models.teacher_model.model_path=/models/teacher"


def verl(*overrides: str):
    return import_config(None, [MODEL, *overrides], fmt="verl")


def line(imp, key: str) -> tuple[str, str]:
    (found,) = [(s, t) for s, k, t in imp.lines if k.split("=")[0] == key]
    return found


# ------------------------------------------------------------------------------ router replay

@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.router_replay.mode",
                                 "actor_rollout_ref.actor.megatron.router_replay.mode",
                                 "actor_rollout_ref.actor.veomni.router_replay.mode"])
def test_r3_is_rollout_routing_replay_on_the_hf_engine(key):
    imp = verl(f"{key}=R3", "actor_rollout_ref.rollout.name=hf")
    assert imp.config["actor.routing_replay"] is True and imp.config["rollout.engine"] == "hf"
    assert line(imp, key)[0] == "translated"


def test_r2_replays_the_rollouts_routing_approximately():
    imp = verl("actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.rollout.name=hf")
    status, why = line(imp, "actor_rollout_ref.actor.router_replay.mode")
    assert imp.config["actor.routing_replay"] is True and status == "approximated"
    assert "R2 replays its own log-prob pass's routing" in why


def test_replay_on_an_engine_fitrl_runs_as_vllm_is_not_translated_and_says_how():
    """veRL's own R3 runs on vLLM or SGLang (its default engine): fitrl's vllm engine records no
    routing, so the import leaves replay off (a config that loads) and says what to give."""
    for engine in ("vllm", "sglang", None):
        imp = verl("actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                   "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                   *([f"actor_rollout_ref.rollout.name={engine}"] if engine else []))
        status, why = line(imp, "actor_rollout_ref.actor.megatron.router_replay.mode")
        assert status == "not translated" and "give actor_rollout_ref.rollout.name=hf to replay" in why
        assert "actor.routing_replay" not in imp.config
        assert line(imp, "actor_rollout_ref.rollout.enable_rollout_routing_replay")[0] == "translated"


def test_disabled_and_unknown_modes_replay_nothing():
    assert "actor.routing_replay" not in verl("actor_rollout_ref.actor.router_replay.mode=disabled").config
    assert line(verl("actor_rollout_ref.actor.router_replay.mode=R9"),
                "actor_rollout_ref.actor.router_replay.mode")[0] == "not translated"


def test_replay_files_and_the_reference_s_mode_are_dropped_with_why():
    imp = verl("actor_rollout_ref.actor.router_replay.record_file=/r.pt", "actor_rollout_ref.ref.router_replay.mode=R3")
    assert "never from a file" in line(imp, "actor_rollout_ref.actor.router_replay.record_file")[1]
    assert "actor.routing_replay" in line(imp, "actor_rollout_ref.ref.router_replay.mode")[1]


# ------------------------------------------------------------------------------ the router's loss

def test_megatron_s_aux_loss_coefficient_is_the_router_aux_loss_coef():
    imp = verl(f"{OVERRIDE}moe_aux_loss_coeff=0.01", f"{OVERRIDE}moe_z_loss_coeff=0.001")
    assert imp.config["actor.router_aux_loss_coef"] == 0.01
    assert line(imp, OVERRIDE[1:] + "moe_aux_loss_coeff")[0] == "approximated"
    assert "z-loss" in line(imp, OVERRIDE[1:] + "moe_z_loss_coeff")[1]  # (not the Megatron backend's generic line)
    assert not any(k.startswith("(veRL's router loss") for _, k, _ in imp.lines)  # the key said it


def test_load_balancing_type_none_turns_the_loss_off_whatever_its_coefficient():
    imp = verl(f"{OVERRIDE}moe_router_load_balancing_type=none", f"{OVERRIDE}moe_aux_loss_coeff=0.01")
    assert imp.config["actor.router_aux_loss_coef"] == 0.0
    kept = verl(f"{OVERRIDE}moe_router_load_balancing_type=aux_loss", f"{OVERRIDE}moe_aux_loss_coeff=0.02")
    assert kept.config["actor.router_aux_loss_coef"] == 0.02
    assert line(verl(f"{OVERRIDE}moe_router_load_balancing_type=sinkhorn"),
                OVERRIDE[1:] + "moe_router_load_balancing_type")[0] == "not translated"


@pytest.mark.parametrize("fmt,overrides", [("verl", [MODEL]), ("easyr1", ["worker.actor.model.model_path=/m"])])
def test_a_source_that_says_nothing_trains_without_the_router_loss(fmt, overrides):
    """veRL's FSDP actor and EasyR1's train on the policy loss alone: the import says so and sets 0
    (fitrl's unset coefficient is the model's, 0.001 for Qwen3-MoE); a dense policy ignores it."""
    imp = import_config(None, overrides, fmt=fmt)
    assert imp.config["actor.router_aux_loss_coef"] == 0.0
    name = {"verl": "veRL", "easyr1": "EasyR1"}[fmt]
    status, text = line(imp, f"({name}'s router loss)")
    assert status == "translated" and "no load-balancing loss" in text


# ------------------------------------------------------------------------------ on-policy distillation

def test_distillation_enabled_with_task_rewards_is_the_mixed_weight():
    """veRL's loss is policy + coef x distillation: fitrl's (1 - w) policy + w distillation at
    w = coef / (1 + coef), the same mix; its defaults (k3 backpropagated, top-k 32) when left out."""
    imp = verl("distillation.enabled=true", TEACHER)
    c = imp.config
    assert (c["algorithm.distill.weight"], c["algorithm.distill.loss"], c["algorithm.distill.top_k"]) == \
        (0.5, "topk_forward_kl", 32)
    assert c["teacher.model.path"] == "/models/teacher"
    assert line(imp, "distillation.enabled")[0] == "approximated"
    assert verl("distillation.enabled=true", "distillation.distillation_loss.distillation_loss_coef=3",
                TEACHER).config["algorithm.distill.weight"] == 0.75


def test_without_task_rewards_it_is_pure_distillation():
    c = verl("distillation.enabled=true", "distillation.distillation_loss.use_task_rewards=false", TEACHER).config
    assert c["algorithm.distill.weight"] == 1.0


def test_disabled_distillation_builds_no_teacher():
    imp = verl("distillation.enabled=false", TEACHER, "distillation.distillation_loss.loss_mode=k1")
    assert not any(k.startswith("algorithm.distill") for k in imp.config)
    assert line(imp, "distillation.enabled") == ("translated", "no teacher, as fitrl's algorithm.distill.weight=0")


@pytest.mark.parametrize("mode,pg,loss,status", [
    ("k1", True, "reverse_kl", "translated"),
    ("forward_kl_topk", False, "topk_forward_kl", "approximated"),
    ("k3", False, "topk_forward_kl", "approximated"),          # backpropagated: the forward KL's gradient
    ("low_var_kl", True, "reverse_kl", "approximated"),       # as a reward
    ("k2", False, "reverse_kl", "approximated"),              # (the same gradient as reverse_kl)
    ("abs", True, "reverse_kl", "approximated"),
])
def test_each_loss_mode_is_fitrl_s_loss(mode, pg, loss, status):
    imp = verl("distillation.enabled=true", TEACHER, f"distillation.distillation_loss.loss_mode={mode}",
               f"distillation.distillation_loss.use_policy_gradient={pg}", "distillation.distillation_loss.topk=16")
    assert imp.config["algorithm.distill.loss"] == loss
    assert imp.config.get("algorithm.distill.top_k") == (16 if loss == "topk_forward_kl" else None)
    assert line(imp, "distillation.distillation_loss.loss_mode")[0] == status


def test_an_unknown_loss_mode_is_dropped_and_the_teacher_s_top_k_kept_only_for_top_k_losses():
    imp = verl("distillation.enabled=true", TEACHER, "distillation.distillation_loss.loss_mode=jsd")
    assert line(imp, "distillation.distillation_loss.loss_mode")[0] == "not translated"
    assert "algorithm.distill.loss" not in imp.config


@pytest.mark.parametrize("key", ["teacher_model", "teacher_model1"])
def test_one_teacher_by_any_entry_name_is_fitrl_s_teacher(key):
    """veRL pops the default entry once another is named: a renamed single teacher is the teacher."""
    imp = verl("distillation.enabled=true", f"+distillation.teacher_models.{key}.model_path=Qwen/Qwen3-32B")
    assert imp.config["teacher.model.path"] == "Qwen/Qwen3-32B"
    assert "is a Hub id" in line(imp, f"distillation.teacher_models.{key}.model_path")[1]


def test_several_teachers_are_not_translated():
    imp = verl("distillation.enabled=true", "+distillation.teacher_models.a.model_path=/t/a",
               "+distillation.teacher_models.b.model_path=/t/b", "distillation.teacher_key=data_source")
    assert "teacher.model.path" not in imp.config
    assert line(imp, "distillation.teacher_models.a.model_path")[0] == "not translated"
    assert "one teacher" in line(imp, "distillation.teacher_key")[1]


def test_what_runs_around_veRL_s_teachers_is_dropped_with_why():
    imp = verl("distillation.enabled=true", TEACHER, "distillation.n_gpus_per_node=4", "distillation.nnodes=1",
               "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
               "distillation.distillation_loss.loss_max_clamp=10.0",
               "distillation.distillation_loss.log_prob_min_clamp=-10.0",
               "distillation.distillation_loss.clip_ratio_high=0.28",
               "actor_rollout_ref.teacher.server_ip=127.0.0.1")
    for key, says in (("distillation.n_gpus_per_node", "policy's devices"),
                      ("distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size",
                       "forward pass"),
                      ("distillation.distillation_loss.loss_max_clamp", "does not clamp"),
                      ("distillation.distillation_loss.clip_ratio_high", "actor.clip_ratio_high"),
                      ("actor_rollout_ref.teacher.server_ip", "GKD recipe")):
        status, why = line(imp, key)
        assert status == "not translated" and says in why, key
    assert not any(why == "no fitrl key for it" for _, _, why in imp.lines)


def test_an_imported_distillation_config_loads_as_fitrl_trains_it(tmp_path):
    """Pure distillation with one sample per prompt loads (the teacher's signal trains, not GRPO's
    group advantage, which fitrl's check otherwise refuses at rollout.n=1); a mixed weight at n=1
    is still refused."""
    imp = verl("distillation.enabled=true", "distillation.distillation_loss.use_task_rewards=false",
               "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
               TEACHER, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=1",
               "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    out = tmp_path / "x.yaml"
    out.write_text(imp.yaml("test"))
    cfg = load_config(str(out))
    assert (cfg.algorithm.distill.weight, cfg.algorithm.distill.loss, cfg.rollout.n) == (1.0, "reverse_kl", 1)
    assert cfg.teacher.model.path == "/models/teacher" and cfg.actor.router_aux_loss_coef == 0.0
    with pytest.raises(ConfigError, match="rollout.n=1: every advantage would be 0"):
        load_config(str(out), ["algorithm.distill.weight=0.5"])
