"""`fitrl import-config`, key by key: each veRL/EasyR1 setting fitrl has is mapped to it (or
approximated, saying how), with the source's own meaning (where its KL goes, its estimator names,
its dict-valued overrides); what fitrl has nothing like is dropped with a true reason. Each case is
checked on the fitrl key it sets, its verdict, and that the result loads."""

from __future__ import annotations

import json

import pytest

import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
from fitrl.algo import KL_ESTIMATORS, POLICY_LOSSES
from fitrl.cli import main
from fitrl.config import ConfigError
from fitrl.config.import_rules import EASYR1_LOSSES, KL_NAMES, VERL_LOSSES
from fitrl.config.importer import import_config
from fitrl.config.loader import config_from_dict
from fitrl.core.nested import nest
from helpers import ROOT

FOREIGN = ROOT / "tests" / "data" / "foreign"
EASYR1_YAML = str(FOREIGN / "easyr1/examples/config.yaml")
MODEL = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


def easyr1(*overrides, source=None):
    # (EasyR1's own default rollout.n=1 under GRPO trains nothing, and fitrl refuses it: n=5 as its examples)
    return import_config(source, ["worker.actor.model.model_path=/m", "worker.rollout.n=5", *overrides], fmt="easyr1")


def verl(*overrides):
    return import_config(None, ["actor_rollout_ref.model.path=/m", *overrides], fmt="verl")


def line(imp, key):
    """(status, text) of the source key's line."""
    found = [(s, t) for s, k, t in imp.lines if k.split("=")[0] == key]
    assert len(found) == 1, (key, imp.report())
    return found[0]


def loads(imp, tmp_path, **extra):
    """The imported config as fitrl validates it (the model: a small config.json)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODEL))
    flat = {**imp.config, "actor.model.path": str(d), **extra}
    if "critic.model.path" in flat:
        flat["critic.model.path"] = str(d)
    return config_from_dict(nest(flat))


# ------------------------------------------------------------------------------- policy losses

@pytest.mark.parametrize("name,loss,status", [
    ("gspo_token", "gspo", "translated"), ("gspo", "gspo", "translated"), ("default", "ppo_clip", "translated"),
    ("cispo", "cispo", "approximated")])
def test_easyr1_loss_type_is_fitrls_loss(name, loss, status, tmp_path):
    imp = easyr1(f"worker.actor.loss_type={name}")
    assert imp.config["algorithm.policy_loss"] == loss and line(imp, "worker.actor.loss_type")[0] == status
    assert loads(imp, tmp_path).algorithm.policy_loss == loss


def test_a_loss_fitrl_lacks_is_dropped_naming_what_trains(tmp_path):
    for imp, key in ((easyr1("worker.actor.loss_type=sapo"), "worker.actor.loss_type"),
                     (verl("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"),
                      "actor_rollout_ref.actor.policy_loss.loss_mode")):
        status, why = line(imp, key)
        assert status == "not translated" and "ppo_clip" in why and "algorithm.policy_loss" not in imp.config
    vanilla = verl("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    assert vanilla.config["algorithm.policy_loss"] == "ppo_clip"


def test_every_mapped_loss_and_kl_name_is_registered():
    assert {loss for loss, _, _ in [*EASYR1_LOSSES.values(), *VERL_LOSSES.values()]} <= set(POLICY_LOSSES.names())
    assert set(KL_NAMES.values()) <= set(KL_ESTIMATORS.names())


# ---------------------------------------------------------------------------------------- KL

@pytest.mark.parametrize("name,fitrl", [("kl", "k1"), ("k1", "k1"), ("abs", "abs"), ("mse", "mse"), ("k2", "k2"),
                                        ("low_var_kl", "low_var_kl"), ("k3", "k3")])
def test_verl_kl_names_are_fitrls_estimators(name, fitrl, tmp_path):
    loss = verl("actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_type={name}")
    reward = verl("algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={name}")
    assert loss.config["algorithm.kl_estimator"] == reward.config["algorithm.kl_in_reward.estimator"] == fitrl
    assert line(loss, "actor_rollout_ref.actor.kl_loss_type")[0] == line(reward, "algorithm.kl_penalty")[0] == \
        "translated"
    assert loads(loss, tmp_path).algorithm.kl_estimator == loads(reward, tmp_path).algorithm.kl_in_reward.estimator


@pytest.mark.parametrize("name,base", [("low_var_kl+", "low_var_kl"), ("k3+", "k3"), ("kl+", "k1")])
def test_a_straight_through_kl_is_k2_in_the_loss_and_its_value_in_the_reward(name, base, tmp_path):
    loss = verl("actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_type={name}")
    assert loss.config["algorithm.kl_estimator"] == "k2"  # k2's gradient: what the '+' trains with
    status, why = line(loss, "actor_rollout_ref.actor.kl_loss_type")
    assert status == "approximated" and "same gradient" in why
    reward = verl("algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={name}")
    assert reward.config["algorithm.kl_in_reward.estimator"] == base  # a reward has no gradient: the value
    assert loads(loss, tmp_path).algorithm.kl_estimator == "k2"
    assert loads(reward, tmp_path).algorithm.kl_in_reward.estimator == base


def test_a_kl_fitrl_cannot_compute_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"algorithm.kl_penalty=full: the KL over the whole vocabulary"):
        easyr1("algorithm.use_kl_loss=true", "algorithm.kl_penalty=full")
    assert main(["import-config", "actor_rollout_ref.actor.kl_loss_type=nonsense", "actor_rollout_ref.model.path=/m",
                 "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "actor_rollout_ref.actor.kl_loss_type=nonsense" in err


def test_easyr1_without_the_kl_loss_puts_the_kl_in_the_reward(tmp_path):
    """EasyR1's trainer subtracts kl_coef x KL from the reward unless use_kl_loss or disable_kl."""
    imp = easyr1("algorithm.use_kl_loss=false", "algorithm.kl_penalty=kl", "algorithm.kl_coef=0.02",
                 "algorithm.kl_type=adaptive", "algorithm.kl_target=0.05", "algorithm.kl_horizon=5000.0")
    c = imp.config
    assert (c["algorithm.use_kl_loss"], c["algorithm.kl_in_reward.enable"]) == (False, True)
    assert (c["algorithm.kl_in_reward.estimator"], c["algorithm.kl_in_reward.coef"]) == ("k1", 0.02)
    assert (c["algorithm.kl_in_reward.controller"], c["algorithm.kl_in_reward.target_kl"],
            c["algorithm.kl_in_reward.horizon"]) == ("adaptive", 0.05, 5000)
    assert "algorithm.kl_estimator" not in c and "algorithm.kl_coef" not in c
    assert "reward" in line(imp, "algorithm.use_kl_loss")[1]
    kr = loads(imp, tmp_path).algorithm.kl_in_reward
    assert (kr.enable, kr.estimator, kr.controller) == (True, "k1", "adaptive")


def test_easyr1_kl_loss_and_kl_off(tmp_path):
    loss = easyr1("algorithm.use_kl_loss=true", "algorithm.kl_penalty=low_var_kl", "algorithm.kl_coef=0.01").config
    assert (loss["algorithm.use_kl_loss"], loss["algorithm.kl_in_reward.enable"]) == (True, False)
    assert (loss["algorithm.kl_estimator"], loss["algorithm.kl_coef"]) == ("low_var_kl", 0.01)
    off = easyr1("algorithm.disable_kl=true", "algorithm.use_kl_loss=false", "algorithm.kl_coef=0.01")
    assert (off.config["algorithm.use_kl_loss"], off.config["algorithm.kl_in_reward.enable"]) == (False, False)
    assert "algorithm.kl_in_reward.coef" not in off.config and "algorithm.kl_coef" not in off.config
    cfg = loads(off, tmp_path)
    assert not cfg.algorithm.use_kl_loss and not cfg.algorithm.kl_in_reward.enable


# ------------------------------------------------------------------------- dict-valued overrides

def test_a_dict_valued_override_merges_into_the_section(tmp_path):
    """EasyR1's DAPO example: val_override_config='{"n":16,...}' over examples/config.yaml's n 1."""
    imp = import_config(EASYR1_YAML, ['worker.rollout.val_override_config={"n":16,"temperature":1.0,"top_p":0.7}'])
    c = imp.config
    assert (c["rollout.val.n"], c["rollout.val.temperature"], c["rollout.val.top_p"]) == (16, 1.0, 0.7)
    assert line(imp, "worker.rollout.val_override_config.n") == ("translated", "rollout.val.n=16")
    assert not any(k == "worker.rollout.val_override_config" for _, k, _ in imp.lines)
    partial = import_config(EASYR1_YAML, ["worker.rollout.val_override_config={n: 4}"]).config  # YAML flow
    assert (partial["rollout.val.n"], partial["rollout.val.temperature"]) == (4, 0.6)  # the others stay
    val = verl("actor_rollout_ref.rollout.val_kwargs={n: 4, temperature: 0.6, do_sample: true}").config
    assert (val["rollout.val.n"], val["rollout.val.temperature"]) == (4, 0.6)
    sixteen = import_config(EASYR1_YAML, ['worker.rollout.val_override_config={"n":16}'])
    assert loads(sixteen, tmp_path).rollout.val.n == 16


# ---------------------------------------------------------------------------------- the reward

DAPO = ['worker.reward.reward_function=./examples/reward_function/dapo.py:compute_score',
        'worker.reward.reward_function_kwargs={"max_response_length":20480,"overlong_buffer_length":4096,'
        '"overlong_penalty_factor":1.0}', "data.max_response_length=20480", "algorithm.online_filtering=True",
        "algorithm.filter_key=accuracy_normalized"]  # EasyR1's examples/qwen3_14b_dapo17k_dapo.sh


def test_easyr1_overlong_buffer_is_fitrls_overlong_shaping(tmp_path):
    imp = easyr1(*DAPO)
    c = imp.config
    assert (c["algorithm.overlong.enable"], c["algorithm.overlong.buffer_length"],
            c["algorithm.overlong.penalty_factor"]) == (True, 4096, 1.0)
    assert c["reward.function"] == "math" and c["rollout.max_response_length"] == 20480
    status, why = line(imp, "worker.reward.reward_function_kwargs.overlong_buffer_length")
    assert status == "translated" and "algorithm.overlong" in why
    assert line(imp, "worker.reward.reward_function_kwargs.max_response_length")[0] == "not translated"
    cfg = loads(imp, tmp_path)
    assert (cfg.algorithm.overlong.enable, cfg.algorithm.overlong.buffer_length) == (True, 4096)


def test_a_filter_key_becomes_a_metric_fitrls_reward_logs(tmp_path):
    imp = easyr1(*DAPO)
    assert imp.config["algorithm.filter_groups.metric"] == "accuracy"  # math logs it; 0.5 (acc + 1) varies alike
    assert line(imp, "algorithm.filter_key")[0] == "approximated"
    assert loads(imp, tmp_path).algorithm.filter_groups.metric == "accuracy"
    overlong = easyr1(*DAPO[:-1], "algorithm.filter_key=overlong")  # a dapo.py metric fitrl's math does not log
    assert "algorithm.filter_groups.metric" not in overlong.config
    assert "total score" in line(overlong, "algorithm.filter_key")[1]
    own = easyr1("worker.reward.reward_function=./my_reward.py:score", "algorithm.filter_key=accuracy")
    assert "algorithm.filter_groups.metric" not in own.config  # the user's function is not translated
    assert easyr1("algorithm.filter_key=overall").config["algorithm.filter_groups.metric"] == "score"
    assert verl("algorithm.filter_groups.metric=acc").config["algorithm.filter_groups.metric"] == "accuracy"
    final = verl("algorithm.filter_groups.metric=seq_final_reward")
    assert final.config["algorithm.filter_groups.metric"] == "score"
    assert line(final, "algorithm.filter_groups.metric")[0] == "approximated"
    custom = verl("custom_reward_function.path=/r.py", "algorithm.filter_groups.metric=acc").config
    assert custom["algorithm.filter_groups.metric"] == "acc"  # the user's function returns it, as in veRL


@pytest.mark.parametrize("key,value,builtin", [
    ("worker.reward.compute_score", "math", "math"), ("worker.reward.compute_score", "r1v", "r1v"),
    ("worker.reward.score_function", "./examples/score_function/math.py:compute_score", "math"),
    ("worker.reward.score_function", "./examples/score_function/r1v.py:compute_score", "r1v")])
def test_older_easyr1_reward_names_pick_fitrls_builtin(key, value, builtin, tmp_path):
    imp = easyr1(f"{key}={value}")
    assert imp.config["reward.function"] == builtin and line(imp, key)[0] == "approximated"
    assert loads(imp, tmp_path).reward.function == builtin


def test_an_older_easyr1_reward_without_a_builtin_is_not_left_to_arith():
    for key, value in (("worker.reward.compute_score", "gsm8k_custom"),
                       ("worker.reward.score_function", "./mine.py:compute_score")):
        imp = easyr1(f"{key}={value}")
        status, why = line(imp, key)
        assert status == "not translated" and "reward.function=path.py:fn" in why and "arith" in why


def test_easyr1_format_weight_is_fitrls_weights(tmp_path):
    imp = easyr1("worker.reward.score_function=./examples/score_function/math.py:compute_score",
                 "worker.reward.score_function_kwargs.format_weight=0.2")
    assert (imp.config["reward.kwargs.format_weight"], imp.config["reward.kwargs.accuracy_weight"]) == (0.2, 0.8)
    assert loads(imp, tmp_path).reward.kwargs == {"format_weight": 0.2, "accuracy_weight": 0.8}
    other = easyr1("worker.reward.reward_function_kwargs.my_option=3")
    assert line(other, "worker.reward.reward_function_kwargs.my_option")[0] == "not translated"


# ------------------------------------------------------------------------- the actor and data

def test_warmup_steps_and_ratio(tmp_path):
    assert easyr1("worker.actor.optim.lr_warmup_steps=10").config["actor.optim.warmup_steps"] == 10
    ratio = easyr1("worker.actor.optim.lr_warmup_ratio=0.1", "trainer.max_steps=200")
    assert ratio.config["actor.optim.warmup_steps"] == 20
    both = easyr1("worker.actor.optim.lr_warmup_ratio=0.1", "trainer.max_steps=200",
                  "worker.actor.optim.lr_warmup_steps=7")
    assert both.config["actor.optim.warmup_steps"] == 7  # EasyR1: the steps win
    unknown = easyr1("worker.actor.optim.lr_warmup_ratio=0.1")
    assert "actor.optim.warmup_steps" not in unknown.config
    assert line(unknown, "worker.actor.optim.lr_warmup_ratio")[0] == "approximated"
    v = verl("actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
             "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05", "trainer.total_training_steps=100")
    assert v.config["actor.optim.warmup_steps"] == 5
    assert loads(ratio, tmp_path).actor.optim.warmup_steps == 20


def test_system_prompt_and_entropy_coefficient(tmp_path):
    imp = easyr1("data.system_prompt='You are a careful solver.'", "worker.actor.entropy_coeff=0.001")
    assert imp.config["data.system_prompt"] == "You are a careful solver."
    assert imp.config["actor.entropy_coeff"] == 0.001
    assert line(imp, "data.system_prompt")[0] == line(imp, "worker.actor.entropy_coeff")[0] == "translated"
    cfg = loads(imp, tmp_path)
    assert (cfg.data.system_prompt, cfg.actor.entropy_coeff) == ("You are a careful solver.", 0.001)


def test_verl_global_critic_micro_batches_are_divided_over_the_devices(tmp_path):
    imp = verl("algorithm.adv_estimator=gae", "critic.model.path=/m", "critic.ppo_micro_batch_size=64",
               "critic.forward_micro_batch_size=128", "trainer.n_gpus_per_node=8")
    assert (imp.config["critic.micro_batch_size"], imp.config["critic.values_micro_batch_size"]) == (8, 16)
    assert line(imp, "critic.ppo_micro_batch_size")[0] == "approximated"
    per_gpu = verl("critic.forward_micro_batch_size_per_gpu=4").config
    assert per_gpu["critic.values_micro_batch_size"] == 4
    assert loads(imp, tmp_path).critic.micro_batch_size == 8


def test_dynamic_batch_size_without_a_token_limit_is_verls_default(tmp_path):
    imp = verl("actor_rollout_ref.actor.use_dynamic_bsz=True")
    assert imp.config["actor.micro_batch_token_budget"] == 16384
    assert line(imp, "actor_rollout_ref.actor.use_dynamic_bsz")[0] == "approximated"
    given = verl("actor_rollout_ref.actor.use_dynamic_bsz=True",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000")
    assert given.config["actor.micro_batch_token_budget"] == 24000
    assert "actor.micro_batch_token_budget" not in verl("actor_rollout_ref.actor.use_dynamic_bsz=False").config
    easy = easyr1("worker.actor.dynamic_batching=true", "worker.actor.micro_batch_size_per_device_for_update=2",
                  "data.max_prompt_length=1024", "data.max_response_length=2048")
    assert easy.config["actor.micro_batch_token_budget"] == 2 * (1024 + 2048)  # EasyR1's dp_actor.py
    assert loads(imp, tmp_path).actor.micro_batch_token_budget == 16384


# --------------------------------------------------------------------------- async and agents

def test_verl_async_rollout_is_on_policy_as_fitrls_sync(tmp_path):
    imp = verl("actor_rollout_ref.rollout.mode=async")
    status, why = line(imp, "actor_rollout_ref.rollout.mode")
    assert status == "translated" and imp.config["rollout.mode"] == "sync" and "docs/async.md" in why
    assert loads(imp, tmp_path).rollout.mode == "sync"


def test_verl_multi_turn_is_fitrls_agent(tmp_path):
    imp = verl("actor_rollout_ref.rollout.multi_turn.enable=true",
               "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
               "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=512",
               "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml",
               "actor_rollout_ref.rollout.multi_turn.format=hermes", "actor_rollout_ref.rollout.agent.num_workers=8")
    c = imp.config
    assert (c["rollout.agent.env"], c["rollout.agent.max_turns"], c["rollout.agent.max_tool_output_chars"]) == \
        ("tools", 5, 512)
    assert line(imp, "actor_rollout_ref.rollout.multi_turn.enable")[0] == "approximated"
    status, why = line(imp, "actor_rollout_ref.rollout.multi_turn.tool_config_path")
    assert status == "not translated" and "rollout.agent.tools" in why
    assert line(imp, "actor_rollout_ref.rollout.multi_turn.format")[0] == "translated"
    assert loads(imp, tmp_path).rollout.agent.env == "tools"
    single = verl("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
                  "actor_rollout_ref.rollout.multi_turn.enable=false")
    assert not any(k.startswith("rollout.agent") for k in single.config)


def test_no_reason_says_fitrl_lacks_async_or_agents():
    scripts = sorted(FOREIGN.rglob("*.sh")) + sorted(FOREIGN.rglob("*.yaml"))
    imports = []
    for p in scripts:
        try:
            imports.append(import_config(str(p)))
        except ConfigError:  # (the corpus's inputs that stop in one line: tests/test_import_corpus.py)
            continue
    imports.append(verl("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=true",
                        "actor_rollout_ref.rollout.multi_turn.interaction_config_path=i.yaml",
                        "actor_rollout_ref.rollout.agent.agent_loop_config_path=a.yaml"))
    for imp in imports:
        for status, key, text in imp.lines:
            assert "not built yet" not in text, key
