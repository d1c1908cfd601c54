"""Each source framework's defaults layer for `fitrl import-config` (fitrl/config/import_defaults.py)
against the published defaults it mirrors (tests/data/foreign/defaults/, each headed by its
repository, path and commit): every value the layer holds is the file's, every other key of the
file whose translation differs from fitrl's default is left to fitrl with a reason, and a command
that sets nothing but the model lands those defaults in a config that loads and plans. Then the
keys once dropped for a false reason ("no fitrl key for it" where fitrl has the setting)."""

from __future__ import annotations

import ast
import json
import re

import pytest
import yaml

import fitrl.rollout  # noqa: F401  (registers the engines: rollout.engine is checked on load)
from fitrl.config import ConfigError, load_config
from fitrl.config.import_defaults import BEYOND_FILE, DEFAULTS, LEFT_TO_FITRL, with_defaults
from fitrl.config.import_maps import EASYR1, EASYR1_PREFIXES, VERL, VERL_PREFIXES
from fitrl.config.import_rules import VERL_TOKEN_LEN, VERL_TOKEN_LEN_DEFAULT, resolve
from fitrl.config.importer import import_config, translate
from fitrl.config.loader import describe_fields
from fitrl.core.nested import flatten
from fitrl.planner import Hardware, plan_config
from helpers import ROOT

FOREIGN = ROOT / "tests" / "data" / "foreign"
FILES = {"verl": FOREIGN / "defaults" / "verl" / "_generated_ppo_trainer.yaml",
         "easyr1": FOREIGN / "defaults" / "easyr1" / "config_defaults.yaml"}
RULES = {"verl": (VERL, VERL_PREFIXES), "easyr1": (EASYR1, EASYR1_PREFIXES)}
MODEL = yaml.safe_load((ROOT / "bench" / "field_corpus" / "models.yaml").read_text())["qwen2.5-7b-instruct"]["config"]


def published(fmt: str) -> dict:
    return flatten(yaml.safe_load(FILES[fmt].read_text()))


def resolved(flat: dict) -> dict:
    """The file's interpolations resolved as OmegaConf would, relative ones (``${.key}``) too."""
    absolute = {}
    for key, value in flat.items():
        parent = key.rsplit(".", 1)[0]
        absolute[key] = re.sub(r"\$\{(oc\.select:)?\.", lambda m: "${" + (m.group(1) or "") + parent + ".",
                               value) if isinstance(value, str) else value
    return {key: resolve(value, absolute) for key, value in absolute.items()}


def fitrl_defaults() -> dict:
    return {key: ast.literal_eval(default) for key, _, default, _ in describe_fields() if _literal(default)}


def _literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
        return True
    except (ValueError, SyntaxError):
        return False


def translated(fmt: str, key: str, value, src: dict) -> list[tuple[str, object]]:
    rules, prefixes = RULES[fmt]
    rule = rules.get(key) or next((r for p, r in prefixes.items() if key.startswith(p)), None)
    if rule is None:
        return []
    rule = rule.choose(value) if rule.choose is not None else rule
    return rule.set(value, src) if rule.set is not None else []


def lines(imported) -> dict[str, tuple[str, str]]:
    return {key.split("=")[0]: (status, text) for status, key, text in imported.lines}


@pytest.mark.parametrize("fmt", ["verl", "easyr1"])
def test_each_defaults_file_names_its_repository_path_and_commit(fmt):
    head = FILES[fmt].read_text().splitlines()[0]
    assert re.match(r"# [\w-]+/[\w-]+ [\w/.{},]+ .*at [0-9a-f]{40} ", head), head


@pytest.mark.parametrize("fmt", ["verl", "easyr1"])
def test_every_value_of_the_layer_is_the_published_one(fmt):
    file = published(fmt)
    for key, value in DEFAULTS[fmt].items():
        assert key in file, f"{key}: not in {FILES[fmt].name}"
        if key in BEYOND_FILE[fmt]:
            assert file[key] in (None, "???"), f"{key}: the file sets {file[key]!r}; mirror it instead"
        else:
            assert (value, type(value) is bool) == (file[key], type(file[key]) is bool), \
                f"{key}: the layer holds {value!r}, {FILES[fmt].name} {file[key]!r}"
        assert translated(fmt, key, value, with_defaults(fmt, {})), f"{key}: its rule sets nothing"


@pytest.mark.parametrize("fmt", ["verl", "easyr1"])
def test_every_key_that_differs_from_fitrl_is_mirrored_or_left_with_a_reason(fmt):
    """The layer cannot miss a default: a key of the file fitrl translates to a value unlike its
    own default is in the layer, or in LEFT_TO_FITRL with why."""
    file, fitrl = resolved(published(fmt)), fitrl_defaults()
    missing = []
    for key, value in file.items():
        if value is None or key in DEFAULTS[fmt] or key in LEFT_TO_FITRL[fmt]:
            continue
        differs = [(k, v) for k, v in translated(fmt, key, value, file) if k in fitrl and fitrl[k] != v]
        if differs:
            missing.append(f"{key}={value!r} -> {differs}")
    assert not missing, "\n".join(missing)
    for key in LEFT_TO_FITRL[fmt]:
        assert key in file and key not in DEFAULTS[fmt], key


def test_veRL_s_token_limit_is_the_published_one():
    assert published("verl")[VERL_TOKEN_LEN] == VERL_TOKEN_LEN_DEFAULT


def _loads_and_plans(imported, tmp_path):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    out = tmp_path / "imported.yaml"
    out.write_text(imported.yaml("test"))
    cfg = load_config(str(out), [f"actor.model.path={model}"])
    plan = plan_config(cfg, Hardware.for_config(cfg))
    assert plan.verdict in ("fits", "tight", "does not fit") and plan.peaks()
    return cfg


def test_a_verl_command_that_sets_only_the_model_keeps_verl_s_defaults(tmp_path):
    imp = import_config(None, ["actor_rollout_ref.model.path=/m"])
    c = imp.config
    assert (c["actor.optim.weight_decay"], c["critic.optim.weight_decay"]) == (0.01, 0.01)
    assert c["actor.model.gradient_checkpointing"] is c["critic.model.gradient_checkpointing"] is True
    assert c["actor.fsdp.mixed_precision"] is c["ref.fsdp.mixed_precision"] is c["critic.fsdp.mixed_precision"] is True
    assert c["critic.mini_batch_size"] == c["actor.mini_batch_size"] == 256  # not fitrl's 8: 32x the critic's steps
    assert (c["rollout.engine"], c["algorithm.adv_estimator"], c["trainer.backend"]) == ("vllm", "gae", "ray")
    assert "(veRL's default)" in next(k for _, k, _ in imp.lines if k.startswith("critic.optim.weight_decay"))
    cfg = _loads_and_plans(imp, tmp_path)
    assert cfg.critic.mini_batch_size == 256 and cfg.actor.optim.weight_decay == 0.01


def test_verl_s_critic_follows_the_actor_unless_set():
    c = import_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                             "actor_rollout_ref.actor.ppo_epochs=2",
                             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]).config
    assert (c["critic.mini_batch_size"], c["critic.ppo_epochs"], c["critic.loss_agg_mode"]) == \
        (64, 2, "seq-mean-token-mean")
    own = import_config(None, ["actor_rollout_ref.model.path=/m", "critic.ppo_mini_batch_size=32"]).config
    assert (own["critic.mini_batch_size"], own["actor.mini_batch_size"]) == (32, 256)


def test_the_easyr1_layer_translates_to_a_config_that_loads_and_plans(tmp_path):
    """EasyR1's own defaults (GRPO, rollout.n=1) train nothing: every group's advantage is 0, and
    fitrl refuses that in one line; so the smallest command that trains also sets n."""
    alone = translate("easyr1", with_defaults("easyr1", {"worker.actor.model.model_path": "/m"}))
    with pytest.raises(ConfigError, match="rollout.n=1: every advantage would be 0"):
        _loads_and_plans(alone, tmp_path)
    imp = translate("easyr1", with_defaults("easyr1", {"worker.actor.model.model_path": "/m", "worker.rollout.n": 5}))
    c = imp.config
    assert (c["rollout.engine"], c["actor.clip_ratio_low"], c["actor.clip_ratio_high"]) == ("vllm", 0.2, 0.3)
    assert c["actor.fsdp.mixed_precision"] is c["ref.fsdp.mixed_precision"] is True
    assert (c["actor.optim.lr"], c["actor.optim.weight_decay"], c["actor.model.gradient_checkpointing"]) == \
        (1e-6, 0.01, True)
    # EasyR1's KL without use_kl_loss: k1 in the reward at 1e-3
    assert (c["algorithm.use_kl_loss"], c["algorithm.kl_in_reward.enable"], c["algorithm.kl_in_reward.estimator"],
            c["algorithm.kl_in_reward.coef"]) == (False, True, "k1", 1e-3)
    assert (c["actor.mini_batch_size"], c["actor.micro_batch_token_budget"]) == (256, 4 * (512 + 512))
    _loads_and_plans(imp, tmp_path)


def test_an_easyr1_command_that_sets_only_the_model_keeps_easyr1_s_defaults(tmp_path):
    imp = import_config(None, ["worker.actor.model.model_path=/m", "worker.rollout.n=5"])
    assert (imp.config["rollout.engine"], imp.config["actor.clip_ratio_high"]) == ("vllm", 0.3)
    assert "(EasyR1's default)" in next(k for _, k, _ in imp.lines if k.startswith("worker.actor.clip_ratio_high"))
    example = import_config(str(FOREIGN / "easyr1" / "examples" / "config.yaml")).config  # sets neither key
    assert (example["rollout.engine"], example["actor.clip_ratio_high"]) == ("vllm", 0.3)
    _loads_and_plans(imp, tmp_path)


# ---------------------------------------------------------------- keys once dropped for a false reason

def _one(overrides: list[str], key: str, fmt: str = "auto"):
    imp = import_config(None, overrides, fmt=fmt)
    status, text = lines(imp)[key]
    assert status != "not translated" and "no fitrl key" not in text, (key, status, text)
    return imp.config


def test_easyr1_gspo_token_trains_gspo():
    assert _one(["worker.actor.loss_type=gspo_token"], "worker.actor.loss_type")["algorithm.policy_loss"] == "gspo"


def test_easyr1_torch_dtype_bf16_computes_in_bf16():
    assert _one(["worker.actor.fsdp.torch_dtype=bf16"], "worker.actor.fsdp.torch_dtype")["actor.fsdp.mixed_precision"]
    assert _one(["worker.ref.fsdp.torch_dtype=bf16"], "worker.ref.fsdp.torch_dtype")["ref.fsdp.mixed_precision"]


def test_easyr1_warmup_steps():
    assert _one(["worker.actor.optim.lr_warmup_steps=10"], "worker.actor.optim.lr_warmup_steps")[
        "actor.optim.warmup_steps"] == 10


def test_overlong_buffer_reward_kwargs_become_fitrl_s_overlong_shaping():
    for prefix in ("worker.reward.reward_function_kwargs.", "worker.reward.score_function_kwargs."):
        c = _one([f"{prefix}overlong_buffer_length=512", f"{prefix}overlong_penalty_factor=1.0"],
                 f"{prefix}overlong_buffer_length")
        assert (c["algorithm.overlong.enable"], c["algorithm.overlong.buffer_length"],
                c["algorithm.overlong.penalty_factor"]) == (True, 512, 1.0)
    c = _one(["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=512"],
             "reward_model.overlong_buffer.len", fmt="verl")
    assert (c["algorithm.overlong.enable"], c["algorithm.overlong.buffer_length"]) == (True, 512)


def test_older_easyr1_reward_names_pick_fitrl_s_built_in():
    c = _one(["worker.reward.score_function=./examples/score_function/math.py:compute_score"],
             "worker.reward.score_function")
    assert c["reward.function"] == "math"
    assert _one(["worker.reward.compute_score=r1v"], "worker.reward.compute_score")["reward.function"] == "r1v"


def test_a_system_prompt():
    assert _one(["data.system_prompt=You are helpful.", "worker.rollout.n=4"], "data.system_prompt")[
        "data.system_prompt"] == "You are helpful."


def test_the_actor_s_entropy_coefficient():
    assert _one(["worker.actor.entropy_coeff=0.01"], "worker.actor.entropy_coeff")["actor.entropy_coeff"] == 0.01
    assert _one(["actor_rollout_ref.actor.entropy_coeff=0.001"], "actor_rollout_ref.actor.entropy_coeff")[
        "actor.entropy_coeff"] == 0.001


def test_verl_s_global_critic_micro_batches_divide_over_the_devices():
    c = _one(["critic.ppo_micro_batch_size=64", "critic.forward_micro_batch_size=128", "trainer.n_gpus_per_node=4"],
             "critic.ppo_micro_batch_size")
    assert (c["critic.micro_batch_size"], c["critic.values_micro_batch_size"]) == (16, 32)


def test_verl_dynamic_batches_without_a_token_limit_take_verl_s_16384():
    c = _one(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.use_dynamic_bsz=true"],
             "actor_rollout_ref.actor.use_dynamic_bsz")
    assert c["actor.micro_batch_token_budget"] == 16384
    given = _one(["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
                  "=8000"], "actor_rollout_ref.actor.use_dynamic_bsz", fmt="verl")
    assert given["actor.micro_batch_token_budget"] == 8000


def test_no_reason_says_async_or_agents_are_not_built():
    imp = import_config(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.mode=async",
                               "actor_rollout_ref.rollout.multi_turn.enable=true",
                               "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml",
                               "actor_rollout_ref.rollout.agent.num_workers=8"])
    seen = lines(imp)
    for key in ("actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                "actor_rollout_ref.rollout.agent.num_workers"):
        assert "not built" not in seen[key][1] and ("docs/async.md" in seen[key][1] or "rollout.agent" in seen[key][1])
    assert seen["actor_rollout_ref.rollout.mode"][0] == "translated"
    assert imp.config["rollout.agent.env"] == "tools"


# ----------------------------------------------------------------- an older release's own layer

FILES["easyr1-0.2"] = FOREIGN / "defaults" / "easyr1-0.2" / "config_defaults.yaml"
RULES["easyr1-0.2"] = RULES["easyr1"]


def test_easyr1_0_2_s_layer_is_its_published_defaults():
    """EasyR1 0.2's layer (its KL switch under worker.actor) against the defaults of its own
    dataclasses, as the current layers are against theirs."""
    name = "easyr1-0.2"
    test_each_defaults_file_names_its_repository_path_and_commit(name)
    test_every_key_that_differs_from_fitrl_is_mirrored_or_left_with_a_reason(name)
    file = published(name)
    in_reward = with_defaults(name, {"worker.actor.use_kl_loss": False})  # (the reward's KL keys count only then)
    for key, value in DEFAULTS[name].items():
        assert key in file, key
        if key not in BEYOND_FILE[name]:
            assert (value, type(value) is bool) == (file[key], type(file[key]) is bool), key
        assert translated(name, key, value, with_defaults(name, {})) or translated(name, key, value, in_reward), key


def test_easyr1_0_2_is_told_by_its_layout_and_its_kl_is_in_the_loss(tmp_path):
    imp = import_config(None, ["worker.actor.model.model_path=/m", "worker.rollout.n=5",
                               "worker.actor.use_kl_loss=true"])
    c = imp.config
    assert (c["algorithm.use_kl_loss"], c["algorithm.kl_in_reward.enable"], c["algorithm.kl_coef"],
            c["algorithm.kl_estimator"]) == (True, False, 1e-3, "low_var_kl")  # worker.actor's, not algorithm's
    assert (c["actor.clip_ratio_low"], c["actor.clip_ratio_high"], c["actor.entropy_coeff"]) == (0.2, 0.2, 1e-3)
    assert c["reward.function"] == "math" and "actor.micro_batch_token_budget" not in c  # 0.2: no dynamic batching
    assert any(n.startswith("EasyR1 0.2's layout (it sets worker.actor.use_kl_loss)") for n in imp.notes)
    assert "(EasyR1 0.2's default)" in next(k for _, k, _ in imp.lines if k.startswith("worker.actor.clip_ratio="))
    reward = import_config(None, ["worker.actor.model.model_path=/m", "worker.rollout.n=5",
                                  "worker.actor.use_kl_loss=false", "algorithm.kl_coef=0.02"]).config
    assert (reward["algorithm.use_kl_loss"], reward["algorithm.kl_in_reward.enable"],
            reward["algorithm.kl_in_reward.coef"], reward["algorithm.kl_in_reward.estimator"]) == \
        (False, True, 0.02, "k1")
    today = import_config(None, ["worker.actor.model.model_path=/m", "worker.rollout.n=5"]).config
    assert today["actor.clip_ratio_high"] == 0.3 and today["algorithm.kl_in_reward.enable"] is True
    _loads_and_plans(imp, tmp_path)
