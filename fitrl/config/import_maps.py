"""Key-by-key maps from veRL's and EasyR1's configs to fitrl's (``fitrl import-config``,
:mod:`fitrl.config.importer`; docs/switching.md is the same map for people).

Each map takes a source key (dotted, as the source's own command line writes it) to a
:class:`Rule`: the fitrl key it sets and how the value converts, how faithful the translation is,
and why when it is not exact. A key with no rule is reported as not translated. The rules that
encode a source's meaning (KL, losses, reward, batching) are built in :mod:`fitrl.config.import_rules`.
"""

from __future__ import annotations

from typing import Any

from fitrl.config.import_defaults import EASYR1_DEFAULTS, VERL_DEFAULTS  # noqa: F401  (read by the importer)
from fitrl.config.import_kl import (KL_COEF_WHY, easyr1_disable_kl, easyr1_kl, easyr1_kl_penalty,
                                    easyr1_use_kl_loss)
from fitrl.config.import_more import EASYR1_MORE, EASYR1_MORE_PREFIXES, LORA_EXCLUDE, VERL_MORE, VERL_MORE_PREFIXES
from fitrl.config.import_moe_opd import VERL_MOE_OPD, VERL_MOE_OPD_PREFIXES
from fitrl.config.import_rules import (AGENTS, APPROXIMATED, EASYR1_LOSSES, NOT_TRANSLATED,  # noqa: F401
                                       REWARD_FILES, ROLLOUT_MODE_ASYNC, TRANSLATED, VERL_LOSSES, Rule, drop,
                                       easyr1_dynamic_batching, easyr1_filter_key, expand_dict_values, kl_name,
                                       multi_turn_enable, policy_loss, reward_file, reward_kwargs, reward_name, to,
                                       verl_dynamic_bsz, verl_filter_metric, warmup_ratio, warmup_steps,
                                       when_multi_turn)
from fitrl.config.import_rules import engine_name, engine_precision, precision, resolve


def _files(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _freq(v: Any) -> int:
    """veRL/EasyR1 write -1 (or null) for "never"; fitrl writes 0."""
    return 0 if v is None or int(v) < 0 else int(v)


def _top_k(v: Any) -> int:
    return 0 if v is None or int(v) < 0 else int(v)


def _gpus(src: dict, key: str, nodes_key: str) -> int:
    return max(1, int(src.get(key, 8) or 8)) * max(1, int(src.get(nodes_key, 1) or 1))


def _per_device(fitrl_key: str, gpus_key: str, nodes_key: str) -> Rule:
    """A global micro-batch divided over the devices (veRL's deprecated non-``_per_gpu`` keys)."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        v = resolve(v, src)  # (veRL's forward micro-batch is its update one, by interpolation)
        return [] if v is None else [(fitrl_key, max(1, int(v) // _gpus(src, gpus_key, nodes_key)))]
    return Rule(setter, APPROXIMATED, "a global micro-batch: divided by the devices")


def _full_shard(role: str) -> Rule:
    """EasyR1's ``enable_full_shard`` (else ZeRO-2-like sharding): each role's own ``fsdp.strategy``."""
    return to(f"{role}.fsdp.strategy", lambda v: "full", APPROXIMATED, "fitrl shards fully (or hybrid across nodes)")


def _loggers(v: Any) -> list[str]:
    names = [v] if isinstance(v, str) else list(v or [])
    out = ["console"] + [n for n in names if n in ("wandb", "tensorboard", "mlflow")]
    return list(dict.fromkeys(out))


def _devices(v: Any, src: dict) -> list[tuple[str, Any]]:
    """veRL and EasyR1 always run Ray workers with FSDP, one device or many: so does the import."""
    return [("trainer.devices_per_node", int(v)), ("trainer.backend", "ray")]


def _nodes(v: Any, src: dict) -> list[tuple[str, Any]]:
    return [("trainer.nnodes", max(1, int(v))), ("trainer.backend", "ray")]


ENGINE = Rule(lambda v, src: [("rollout.engine", engine_name(v))], TRANSLATED)
ENGINE_APPROX = Rule(lambda v, src: [("rollout.engine", engine_name(v))], APPROXIMATED,
                     "fitrl's engines are hf and vllm: SGLang runs as vllm")


NO_EFFECT = "no effect in fitrl"
CRITIC_BY_COUNT = "fitrl's critic micro-batches are counted in sequences (critic.micro_batch_size): no token budget"
ALL_PROMPTS_FIT = "fitrl drops prompts longer than data.max_prompt_length and counts them at start-up"
EPOCHS = "fitrl counts steps: set trainer.max_steps (epochs x training rows / data.rollout_batch_size)"
HUB = "kept, and read through the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE; docs/hub.md)"


VERL_ACTOR_DTYPE = ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
                    "actor_rollout_ref.actor.fsdp_config.param_dtype", "actor_rollout_ref.actor.fsdp_config.dtype")
EASYR1_ACTOR_DTYPE = ("worker.actor.fsdp.mp_param_dtype", "worker.actor.fsdp.torch_dtype")


VERL: dict[str, Rule] = {
    # dtypes (veRL: bf16 compute on fp32 weights unless told; fsdp_config.dtype since its FSDPEngineConfig)
    "actor_rollout_ref.actor.fsdp_config.dtype": precision("actor.fsdp.mixed_precision"),
    "actor_rollout_ref.ref.fsdp_config.dtype": precision("ref.fsdp.mixed_precision"),
    "critic.model.fsdp_config.dtype": precision("critic.fsdp.mixed_precision"),
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": precision("actor.fsdp.mixed_precision"),
    "actor_rollout_ref.actor.fsdp_config.param_dtype": precision("actor.fsdp.mixed_precision"),
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype": precision("ref.fsdp.mixed_precision"),
    "actor_rollout_ref.ref.fsdp_config.param_dtype": precision("ref.fsdp.mixed_precision"),
    "critic.model.fsdp_config.mixed_precision.param_dtype": precision("critic.fsdp.mixed_precision"),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": precision("actor.fsdp.mixed_precision", weights=True),
    "actor_rollout_ref.rollout.dtype": engine_precision(VERL_ACTOR_DTYPE),
    "data.train_files": to("data.train_files", _files),
    "data.val_files": to("data.val_files", _files),
    "data.prompt_key": to("data.prompt_key"),
    "data.reward_fn_key": to("data.source_key"),
    "data.max_prompt_length": to("data.max_prompt_length"),
    "data.max_response_length": to("rollout.max_response_length"),
    "data.train_batch_size": to("data.rollout_batch_size"),
    "data.val_batch_size": Rule(lambda v, src: [("data.val_batch_size", v)] if v else [], TRANSLATED),
    "data.shuffle": to("data.shuffle"),
    "data.seed": to("trainer.seed", status=APPROXIMATED, why="fitrl has one seed for the run"),
    "data.image_key": to("data.image_key"),
    "data.video_key": to("data.video_key"),
    "data.filter_overlong_prompts": drop(ALL_PROMPTS_FIT),
    "data.truncation": drop(ALL_PROMPTS_FIT),
    "data.gen_batch_size": drop("fitrl's dynamic sampling draws data.rollout_batch_size prompts per round"),
    "actor_rollout_ref.model.path": to("actor.model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": to("actor.model.gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": to("actor.packing", bool),
    "actor_rollout_ref.model.lora_rank": to("actor.lora.rank"),
    "actor_rollout_ref.model.lora_alpha": to("actor.lora.alpha"),
    "actor_rollout_ref.model.target_modules": to("actor.lora.target_modules", _files),
    "actor_rollout_ref.actor.optim.lr": to("actor.optim.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": to("actor.optim.weight_decay"),
    "actor_rollout_ref.actor.optim.betas": to("actor.optim.betas", list),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": Rule(warmup_steps, TRANSLATED),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": warmup_ratio(
        "actor_rollout_ref.actor.optim.lr_warmup_steps", "trainer.total_training_steps"),
    "actor_rollout_ref.actor.optim.warmup_style": to("actor.optim.lr_schedule"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": to("actor.optim.lr_schedule"),
    "actor_rollout_ref.actor.optim.min_lr_ratio": to("actor.optim.min_lr_ratio", lambda v: v or 0.0),
    "actor_rollout_ref.actor.ppo_mini_batch_size": to("actor.mini_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": to("actor.micro_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": _per_device("actor.micro_batch_size", "trainer.n_gpus_per_node",
                                                                "trainer.nnodes"),
    "actor_rollout_ref.actor.use_dynamic_bsz": Rule(None, choose=verl_dynamic_bsz),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Rule(
        lambda v, src: [("actor.micro_batch_token_budget", int(v))]
        if str(src.get("actor_rollout_ref.actor.use_dynamic_bsz", "")).lower() == "true" else [],
        APPROXIMATED, "fitrl's token budget bounds the padded tokens of a micro-batch"),
    "actor_rollout_ref.actor.ppo_epochs": to("actor.ppo_epochs"),
    "actor_rollout_ref.actor.shuffle": to("actor.shuffle_mini_batches"),
    "actor_rollout_ref.actor.clip_ratio": Rule(lambda v, src: [("actor.clip_ratio_low", v), ("actor.clip_ratio_high", v)]),
    "actor_rollout_ref.actor.clip_ratio_low": to("actor.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": to("actor.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": to("actor.clip_ratio_c"),
    "actor_rollout_ref.actor.loss_agg_mode": to("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": policy_loss(VERL_LOSSES, "loss_mode"),
    "actor_rollout_ref.actor.entropy_coeff": to("actor.entropy_coeff"),
    "actor_rollout_ref.actor.use_kl_loss": to("algorithm.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": to("algorithm.kl_coef"),
    "actor_rollout_ref.actor.kl_loss_type": kl_name("algorithm.kl_estimator", True,
                                                             "actor_rollout_ref.actor.kl_loss_type"),
    "actor_rollout_ref.actor.grad_clip": to("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": to("actor.fsdp.offload_params"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": to("actor.fsdp.offload_optimizer"),
    "actor_rollout_ref.actor.fsdp_config.offload_policy": to("actor.fsdp.cpu_offload"),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": to("actor.ulysses_size", lambda v: max(1, int(v or 1))),
    "actor_rollout_ref.model.use_fused_kernels": drop(NO_EFFECT),
    "actor_rollout_ref.model.trust_remote_code": drop(NO_EFFECT),
    "actor_rollout_ref.rollout.mode": Rule(None, choose=lambda v: to("rollout.mode", lambda v: "sync", TRANSLATED,
                                                                     "" if v == "sync" else ROLLOUT_MODE_ASYNC)),
    "actor_rollout_ref.rollout.enable_chunked_prefill": drop(NO_EFFECT),
    "actor_rollout_ref.rollout.load_format": drop(NO_EFFECT),
    "actor_rollout_ref.rollout.layered_summon": drop(NO_EFFECT),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": drop(
        "fitrl's actor.micro_batch_token_budget bounds the log-prob passes too (see ppo_max_token_len_per_gpu)"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": drop("see ppo_max_token_len_per_gpu"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": drop("see ppo_max_token_len_per_gpu"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": drop("see ppo_max_token_len_per_gpu"),
    "data.return_raw_chat": drop(NO_EFFECT),
    "critic.model.use_remove_padding": to("critic.packing", bool),
    "critic.use_dynamic_bsz": drop(CRITIC_BY_COUNT),
    "critic.forward_max_token_len_per_gpu": drop(CRITIC_BY_COUNT),
    "critic.ppo_max_token_len_per_gpu": drop(CRITIC_BY_COUNT),
    "actor_rollout_ref.rollout.name": Rule(None, choose=lambda v: ENGINE_APPROX if str(v) == "sglang" else ENGINE),
    # multi-turn (veRL's rollout.multi_turn; fitrl's rollout.agent, docs/agents.md)
    "actor_rollout_ref.rollout.multi_turn.enable": multi_turn_enable(),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": when_multi_turn("rollout.agent.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": when_multi_turn(
        "rollout.agent.max_tool_output_chars", why="characters, as in veRL"),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": drop(
        "fitrl's environment replies after each model turn, up to rollout.agent.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": drop(
        "fitrl runs every call of a turn, on rollout.agent.tool_workers processes"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": drop(
        f"veRL's tool classes do not run in fitrl: {AGENTS}; write each tool as a Python function with type hints "
        f"and a docstring and list it in rollout.agent.tools"),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": drop(
        f"veRL's interactions: {AGENTS}; write a fitrl Environment and set rollout.agent.env=path.py:Class"),
    "actor_rollout_ref.rollout.multi_turn.format": Rule(None, choose=lambda v: Rule(
        None, TRANSLATED, "fitrl parses Hermes tool calls") if v == "hermes" else drop(
        f"fitrl parses Hermes tool calls (<tool_call>{{json}}</tool_call>) only, not {v}")),
    "actor_rollout_ref.rollout.n": to("rollout.n"),
    "actor_rollout_ref.rollout.temperature": to("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": to("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": to("rollout.top_k", _top_k),
    "actor_rollout_ref.rollout.response_length": to("rollout.max_response_length"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": to("rollout.gpu_memory_utilization"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": to("rollout.tensor_parallel_size"),
    "actor_rollout_ref.rollout.enforce_eager": to("rollout.enforce_eager"),
    "actor_rollout_ref.rollout.enable_prefix_caching": to("rollout.enable_prefix_caching"),
    "actor_rollout_ref.rollout.free_cache_engine": to("rollout.sleep_level", lambda v: 1 if v else 0,
                                                      APPROXIMATED, "a freed cache is vLLM sleep level 1"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": to("actor.logprob_micro_batch_size"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _per_device(
        "actor.logprob_micro_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": to("rollout.val.temperature"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": to("rollout.val.top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": to("rollout.val.top_k", _top_k),
    "actor_rollout_ref.rollout.val_kwargs.n": to("rollout.val.n"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Rule(
        lambda v, src: [] if v else [("rollout.val.temperature", 0.0)], TRANSLATED),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": to("ref.logprob_micro_batch_size"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": _per_device(
        "ref.logprob_micro_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": to("ref.fsdp.offload_params"),
    "algorithm.adv_estimator": to("algorithm.adv_estimator"),
    "algorithm.norm_adv_by_std_in_grpo": to("algorithm.norm_adv_by_std"),
    "algorithm.gamma": to("algorithm.gamma"),
    "algorithm.lam": to("algorithm.lam"),
    "algorithm.use_kl_in_reward": to("algorithm.kl_in_reward.enable"),
    "algorithm.kl_penalty": kl_name("algorithm.kl_in_reward.estimator", False, "algorithm.kl_penalty"),
    "algorithm.kl_ctrl.type": to("algorithm.kl_in_reward.controller"),
    "algorithm.kl_ctrl.kl_coef": to("algorithm.kl_in_reward.coef"),
    "algorithm.kl_ctrl.target_kl": to("algorithm.kl_in_reward.target_kl"),
    "algorithm.kl_ctrl.horizon": to("algorithm.kl_in_reward.horizon"),
    "algorithm.filter_groups.enable": to("algorithm.filter_groups.enable"),
    "algorithm.filter_groups.metric": Rule(None, choose=verl_filter_metric),
    "algorithm.filter_groups.max_num_gen_batches": to("algorithm.filter_groups.max_num_gen_batches"),
    "reward_model.enable": Rule(None, choose=lambda v: Rule(
        lambda v, src: [("reward.sources.rm.kind", "model"), ("reward.sources.rm.weight", 1.0)], APPROXIMATED,
        "veRL's reward model scores alone, as here (reward.sources.rm: docs/reward-models.md); it is read "
        "through its own tokenizer's chat template") if v else drop("no reward model")),
    "reward_model.model.path": to("reward.sources.rm.model.path"),
    "reward_model.model.input_tokenizer": drop("fitrl renders prompt + response with the reward model's own "
                                               "chat template (the policy's tokenizer is never used for it)"),
    "reward_model.model.fsdp_config.param_offload": to("reward.sources.rm.fsdp.offload_params"),
    "reward_model.micro_batch_size_per_gpu": to("reward.sources.rm.micro_batch_size"),
    "reward_model.max_length": to("reward.sources.rm.max_length", lambda v: 0 if v is None else int(v)),
    "reward_model.reward_manager": drop(NO_EFFECT),
    "reward_model.overlong_buffer.enable": to("algorithm.overlong.enable"),
    "reward_model.overlong_buffer.len": to("algorithm.overlong.buffer_length"),
    "reward_model.overlong_buffer.penalty_factor": to("algorithm.overlong.penalty_factor"),
    "custom_reward_function.path": Rule(
        lambda v, src: [("reward.function", f"{v}:{src.get('custom_reward_function.name') or 'compute_score'}")],
        TRANSLATED),
    "custom_reward_function.name": drop("joined to custom_reward_function.path"),
    "critic.model.path": to("critic.model.path"),
    "critic.model.enable_gradient_checkpointing": to("critic.model.gradient_checkpointing"),
    "critic.model.fsdp_config.param_offload": to("critic.fsdp.offload_params"),
    "critic.model.fsdp_config.optimizer_offload": to("critic.fsdp.offload_optimizer"),
    "critic.optim.lr": to("critic.optim.lr"),
    "critic.optim.weight_decay": to("critic.optim.weight_decay"),
    "critic.grad_clip": to("critic.optim.grad_clip"),
    "critic.loss_agg_mode": to("critic.loss_agg_mode"),
    "critic.ppo_mini_batch_size": to("critic.mini_batch_size"),
    "critic.ppo_micro_batch_size_per_gpu": to("critic.micro_batch_size"),
    "critic.ppo_micro_batch_size": _per_device("critic.micro_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"),
    "critic.forward_micro_batch_size_per_gpu": to("critic.values_micro_batch_size"),
    "critic.forward_micro_batch_size": _per_device("critic.values_micro_batch_size", "trainer.n_gpus_per_node",
                                                   "trainer.nnodes"),
    "critic.ppo_epochs": to("critic.ppo_epochs"),
    "critic.cliprange_value": to("critic.cliprange_value"),
    "trainer.total_epochs": drop(EPOCHS),
    "trainer.total_training_steps": to("trainer.max_steps"),
    "trainer.project_name": to("trainer.project_name"),
    "trainer.experiment_name": to("trainer.experiment_name"),
    "trainer.logger": to("trainer.loggers", _loggers),
    "trainer.n_gpus_per_node": Rule(_devices),
    "trainer.nnodes": Rule(_nodes),
    "trainer.save_freq": to("checkpoint.save_freq", _freq),
    "trainer.test_freq": to("trainer.val_freq", _freq),
    "trainer.val_before_train": to("trainer.val_before_train"),
    "trainer.critic_warmup": to("critic.warmup_steps"),
    "trainer.log_val_generations": to("trainer.log_samples"),
    "trainer.default_local_dir": to("trainer.output_dir", status=APPROXIMATED,
                                    why="fitrl writes a run directory (checkpoints inside) below it"),
}
"""veRL (``verl.trainer.main_ppo``; its ``ppo_trainer.yaml`` keys)."""
VERL.update(VERL_MORE)
VERL.update(VERL_MOE_OPD)

VERL_PREFIXES: dict[str, Rule] = {
    "actor_rollout_ref.rollout.engine_kwargs.": drop(NO_EFFECT),
    "actor_rollout_ref.actor.policy_loss.": drop("parameters of veRL's other policy losses (clip_cov, kl_cov, "
                                                 "geo_mean): fitrl has ppo_clip, gspo, cispo"),
    "actor_rollout_ref.rollout.multi_turn.": drop(f"no such setting in {AGENTS}"),
    "actor_rollout_ref.rollout.agent.": drop(f"veRL's agent-loop workers and servers: {AGENTS}, run by the policy's "
                                             f"ranks (or rollout.workers)"),
    "actor_rollout_ref.actor.checkpoint.": drop("fitrl's checkpoints always hold what a resume needs"),
    "actor_rollout_ref.actor.profiler.": drop(NO_EFFECT),
    "reward_model.model.": drop(NO_EFFECT),
    **VERL_MORE_PREFIXES,
    **VERL_MOE_OPD_PREFIXES,
}
"""Rules for every key below a section."""

EASYR1: dict[str, Rule] = {
    # dtypes (EasyR1: bf16 compute, fp32 actor weights, unless told)
    "worker.actor.fsdp.mp_param_dtype": precision("actor.fsdp.mixed_precision"),
    "worker.actor.fsdp.torch_dtype": precision("actor.fsdp.mixed_precision", weights=True),
    "worker.ref.fsdp.mp_param_dtype": precision("ref.fsdp.mixed_precision"),
    "worker.ref.fsdp.torch_dtype": precision("ref.fsdp.mixed_precision", weights=True),
    "worker.rollout.dtype": engine_precision(EASYR1_ACTOR_DTYPE),
    "data.train_files": to("data.train_files", _files),
    "data.val_files": to("data.val_files", _files),
    "data.prompt_key": to("data.prompt_key"),
    "data.answer_key": to("data.answer_key"),
    "data.image_key": to("data.image_key"),
    "data.video_key": to("data.video_key"),
    "data.image_dir": to("data.image_dir"),
    "data.video_fps": to("data.video_fps"),
    "data.max_prompt_length": to("data.max_prompt_length"),
    "data.max_response_length": to("rollout.max_response_length"),
    "data.rollout_batch_size": to("data.rollout_batch_size"),
    "data.mini_rollout_batch_size": drop("fitrl's dynamic sampling draws data.rollout_batch_size prompts per round"),
    "data.val_batch_size": Rule(lambda v, src: [("data.val_batch_size", v)] if v and int(v) > 0 else [], TRANSLATED),
    "data.format_prompt": drop("read separately (the template file)"),
    "data.override_chat_template": drop("fitrl uses the tokenizer's own chat template"),
    "data.shuffle": to("data.shuffle"),
    "data.seed": to("trainer.seed", status=APPROXIMATED, why="fitrl has one seed for the run"),
    "data.min_pixels": to("data.min_pixels"),
    "data.max_pixels": to("data.max_pixels"),
    "data.filter_overlong_prompts": drop(ALL_PROMPTS_FIT),
    "algorithm.adv_estimator": to("algorithm.adv_estimator"),
    # KL: nowhere (disable_kl), in the loss (use_kl_loss) or else in the reward (import_rules.easyr1_kl_mode)
    "algorithm.disable_kl": easyr1_disable_kl(),
    "algorithm.use_kl_loss": easyr1_use_kl_loss(),
    "algorithm.kl_penalty": easyr1_kl_penalty(),
    "algorithm.kl_coef": easyr1_kl("algorithm.kl_coef", "algorithm.kl_in_reward.coef", why=KL_COEF_WHY),
    "algorithm.kl_type": easyr1_kl(None, "algorithm.kl_in_reward.controller",
                                   why="the controller of a KL in the reward (EasyR1's loss KL keeps kl_coef)"),
    "algorithm.kl_horizon": easyr1_kl(None, "algorithm.kl_in_reward.horizon", lambda v: int(float(v))),
    "algorithm.kl_target": easyr1_kl(None, "algorithm.kl_in_reward.target_kl"),
    "algorithm.online_filtering": to("algorithm.filter_groups.enable", bool, APPROXIMATED,
                                     "fitrl drops groups whose rewards are all equal (DAPO's dynamic sampling)"),
    "algorithm.filter_key": easyr1_filter_key(),
    "algorithm.filter_low": drop("fitrl keeps every group whose rewards vary"),
    "algorithm.filter_high": drop("fitrl keeps every group whose rewards vary"),
    "worker.actor.global_batch_size": to("actor.mini_batch_size"),
    "worker.actor.micro_batch_size_per_device_for_update": to("actor.micro_batch_size"),
    "worker.actor.micro_batch_size_per_device_for_experience": Rule(
        lambda v, src: [("actor.logprob_micro_batch_size", v), ("ref.logprob_micro_batch_size", v)]),
    "worker.actor.max_grad_norm": to("actor.optim.grad_clip"),
    "worker.actor.clip_ratio_low": to("actor.clip_ratio_low"),
    "worker.actor.clip_ratio_high": to("actor.clip_ratio_high"),
    "worker.actor.clip_ratio_dual": to("actor.clip_ratio_c"),
    "worker.actor.loss_avg_mode": to("algorithm.loss_agg_mode",
                                     lambda v: {"token": "token-mean", "seq": "seq-mean-token-mean"}.get(v, v)),
    "worker.actor.ppo_epochs": to("actor.ppo_epochs"),
    "worker.actor.padding_free": to("actor.packing", bool),
    "worker.actor.dynamic_batching": Rule(None, choose=easyr1_dynamic_batching),
    "worker.actor.loss_type": policy_loss(EASYR1_LOSSES, "loss_type"),
    "worker.actor.entropy_coeff": to("actor.entropy_coeff"),  # (older EasyR1: removed in its #132)
    "worker.actor.ulysses_size": to("actor.ulysses_size", lambda v: max(1, int(v or 1))),
    "worker.actor.model.model_path": to("actor.model.path"),
    "worker.actor.model.enable_gradient_checkpointing": to("actor.model.gradient_checkpointing"),
    "worker.actor.model.freeze_vision_tower": to("actor.model.freeze_vision_tower"),
    "worker.actor.model.trust_remote_code": drop(NO_EFFECT),
    "worker.actor.model.lora.rank": to("actor.lora.rank"),
    "worker.actor.model.lora.alpha": to("actor.lora.alpha"),
    "worker.actor.model.lora.target_modules": to("actor.lora.target_modules",
                                                 lambda v: v.split(",") if isinstance(v, str) else list(v)),
    "worker.actor.model.lora.exclude_modules": LORA_EXCLUDE,
    "worker.actor.optim.lr": to("actor.optim.lr"),
    "worker.actor.optim.weight_decay": to("actor.optim.weight_decay"),
    "worker.actor.optim.strategy": to("actor.optim.fused", lambda v: True, APPROXIMATED,
                                      "fitrl's AdamW keeps fp32 states (no adamw_bf16)"),
    "worker.actor.optim.lr_warmup_ratio": warmup_ratio("worker.actor.optim.lr_warmup_steps", "trainer.max_steps"),
    "worker.actor.optim.lr_warmup_steps": Rule(warmup_steps, TRANSLATED),
    "worker.actor.fsdp.enable_full_shard": _full_shard("actor"),
    "worker.actor.fsdp.enable_cpu_offload": to("actor.fsdp.cpu_offload"),
    "worker.actor.fsdp.enable_rank0_init": to("actor.fsdp.init", lambda v: "rank0" if v else "every_rank"),
    "worker.actor.offload.offload_params": to("actor.fsdp.offload_params"),
    "worker.actor.offload.offload_optimizer": to("actor.fsdp.offload_optimizer"),
    "worker.rollout.name": Rule(None, choose=lambda v: ENGINE_APPROX if str(v) == "sglang" else ENGINE),
    "worker.rollout.n": to("rollout.n"),
    "worker.rollout.temperature": to("rollout.temperature"),
    "worker.rollout.top_p": to("rollout.top_p"),
    "worker.rollout.top_k": to("rollout.top_k", _top_k),
    "worker.rollout.limit_images": Rule(lambda v, src: [("data.limit_images", int(v))] if v else [], TRANSLATED),
    "worker.rollout.gpu_memory_utilization": to("rollout.gpu_memory_utilization"),
    "worker.rollout.enforce_eager": to("rollout.enforce_eager"),
    "worker.rollout.enable_chunked_prefill": drop(NO_EFFECT),
    "worker.rollout.tensor_parallel_size": to("rollout.tensor_parallel_size"),
    "worker.rollout.disable_tqdm": drop(NO_EFFECT),
    "worker.rollout.val_override_config.temperature": to("rollout.val.temperature"),
    "worker.rollout.val_override_config.top_p": to("rollout.val.top_p"),
    "worker.rollout.val_override_config.n": to("rollout.val.n"),
    "worker.rollout.val_override_config.top_k": to("rollout.val.top_k", _top_k),
    # the reward (worker.reward.reward_function: importer._special); older EasyR1's names
    "worker.reward.compute_score": reward_name(),
    "worker.reward.score_function": reward_file(),
    "worker.reward.reward_type": Rule(None, choose=lambda v: Rule(None, TRANSLATED, "a rule function, as fitrl's")
                                      if v == "function" else drop(f"EasyR1's {v} reward: set reward.sources "
                                                                   f"(docs/reward-models.md)")),
    "data.system_prompt": to("data.system_prompt"),
    "trainer.total_episodes": drop(EPOCHS),
    "worker.ref.fsdp.enable_full_shard": _full_shard("ref"),
    "worker.ref.fsdp.enable_cpu_offload": to("ref.fsdp.cpu_offload"),
    "worker.ref.fsdp.enable_rank0_init": to("ref.fsdp.init", lambda v: "rank0" if v else "every_rank"),
    "worker.ref.offload.offload_params": to("ref.fsdp.offload_params"),
    "trainer.total_epochs": drop(EPOCHS),
    "trainer.max_steps": Rule(lambda v, src: [("trainer.max_steps", int(v))] if v else [], TRANSLATED),
    "trainer.project_name": to("trainer.project_name"),
    "trainer.experiment_name": to("trainer.experiment_name"),
    "trainer.logger": to("trainer.loggers", _loggers, APPROXIMATED, "metrics.jsonl is always written (EasyR1's file)"),
    "trainer.nnodes": Rule(_nodes),
    "trainer.n_gpus_per_node": Rule(_devices),
    "trainer.max_try_make_batch": to("algorithm.filter_groups.max_num_gen_batches", lambda v: 10 if int(v) < 0 else v),
    "trainer.val_freq": to("trainer.val_freq", _freq),
    "trainer.val_before_train": to("trainer.val_before_train"),
    "trainer.val_only": to("trainer.val_only"),
    "trainer.val_generations_to_log": to("trainer.log_samples"),
    "trainer.save_freq": to("checkpoint.save_freq", _freq),
    "trainer.save_limit": to("checkpoint.save_limit", lambda v: 0 if int(v) < 0 else v),
    "trainer.save_model_only": drop("fitrl's checkpoints hold what a resume needs; fitrl export writes a model"),
    "trainer.save_checkpoint_path": Rule(lambda v, src: [("trainer.output_dir", v)] if v else [], APPROXIMATED,
                                         "fitrl writes a run directory (checkpoints inside) below it"),
    "trainer.load_checkpoint_path": Rule(lambda v, src: [("checkpoint.resume", v)] if v else [], TRANSLATED),
    "trainer.find_last_checkpoint": Rule(lambda v, src: [("checkpoint.resume", "auto")] if v else [], TRANSLATED),
}
"""EasyR1 (``verl.trainer.main config=...``; its ``examples/config.yaml`` keys)."""
EASYR1.update(EASYR1_MORE)

EASYR1.update(reward_kwargs("worker.reward.reward_function_kwargs."))
EASYR1.update(reward_kwargs("worker.reward.score_function_kwargs."))

EASYR1_PREFIXES: dict[str, Rule] = {
    "worker.reward.reward_function_kwargs.": drop("an argument of EasyR1's reward function: fitrl's built-ins "
                                                  "take theirs in reward.kwargs (fitrl config --doc)"),
    "worker.reward.score_function_kwargs.": drop("an argument of EasyR1's reward function: fitrl's built-ins "
                                                 "take theirs in reward.kwargs (fitrl config --doc)"),
    **EASYR1_MORE_PREFIXES,
}
"""Rules for every key below a section."""

SPECIAL = frozenset({"worker.reward.reward_function", "data.format_prompt"})
"""Keys the importer reads together with others (fitrl/config/importer.py, ``_special``)."""
