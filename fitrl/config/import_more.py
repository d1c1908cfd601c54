"""The rest of veRL's and EasyR1's keys for :mod:`fitrl.config.import_maps`: the names their older
releases used (still in scripts people run), the settings of what runs around their trainers
(Megatron, reward-model servers, profilers, checkpoint housekeeping), and the keys of projects that
fork them (Search-R1, simpleRL-reason), each translated or dropped with the true reason.

A key is here when ``fitrl import-config`` would otherwise say "no fitrl key for it" about a setting
fitrl has, or about one whose reason a user needs (what fitrl does instead). The corpus of real
scripts that found them is tests/data/foreign/ (tests/test_import_corpus.py).
"""

from __future__ import annotations

from typing import Any

from fitrl.config.import_kl import v02_kl_loss_type, v02_loss_kl, v02_use_kl_loss
from fitrl.config.import_moe_opd import router_replay_rules, teacher_path_rules
from fitrl.config.import_rules import (AGENTS, APPROXIMATED, TRANSLATED, Rule, drop, is_true, to, warmup_ratio,
                                       warmup_steps)

MEGATRON = ("veRL's Megatron-LM backend (tensor, pipeline and expert parallel training): fitrl shards each role over "
            "the devices with FSDP2 (<role>.sharding, docs/distributed.md); its tensor parallelism is the vLLM "
            "engine's (rollout.tensor_parallel_size)")
REWARD_LOOP = ("veRL serves the reward model from vLLM workers of its own (its reward loop): fitrl scores with it on "
               "the trainer's ranks (reward.sources.rm, docs/reward-models.md)")
VLLM_DEFAULT = ("a vLLM scheduler limit: fitrl's vLLM engine keeps vLLM's default (rollout.gpu_memory_utilization "
                "sizes it)")
LORA_EXCLUDE = drop(
    "fitrl has no exclude list, and all-linear adapts a vision tower's linears too: to keep LoRA off the tower, "
    "set actor.lora.target_modules to names only the language model has, e.g. q_proj,k_proj,v_proj,o_proj "
    "(docs/vision.md)")
GRAD_OFFLOAD = ("older veRL's gradient offload (veRL has dropped it): fitrl moves gradients to host memory only "
                "with the shards and the optimizer step, under <role>.fsdp.cpu_offload")
SAPO = "SAPO's gate temperatures: fitrl has no SAPO loss (the run trains algorithm.policy_loss=ppo_clip)"
OVERLONG = "fitrl applies DAPO's overlong ramp as reward shaping (algorithm.overlong), not in the reward manager"
MODEL_LEN = "fitrl's vLLM engine takes its model length from data.max_prompt_length + rollout.max_response_length"
REJECTION = ("veRL's rejection of samples whose importance ratio is out of bounds: fitrl's correction truncates the "
             "weight instead (algorithm.rollout_correction.cap)")
KEEP_ALL = "fitrl keeps every checkpoint unless checkpoint.save_limit says how many"


def _engine_kind(v: Any) -> Rule:
    """``strategy``: ``fsdp``/``fsdp2`` is fitrl's FSDP2; ``megatron`` is not."""
    if str(v).startswith("fsdp"):
        return Rule(None, TRANSLATED, "FSDP, as fitrl's <role>.sharding=fsdp2")
    return drop(MEGATRON)


def _fsdp_size(role: str) -> Rule:
    """veRL's ``fsdp_size``: -1 shards over every device; n shards within groups of n (replicated across)."""
    def setter(v: Any, src: dict) -> list[tuple[str, Any]]:
        per_node = int(src.get("trainer.n_gpus_per_node", 8) or 8)
        if int(v) == per_node and int(src.get("trainer.nnodes", 1) or 1) > 1:
            return [(f"{role}.fsdp.strategy", "hybrid")]
        return [(f"{role}.fsdp.strategy", "full")]
    return Rule(setter, APPROXIMATED, "-1 (every device) is fitrl's full; a node's devices across nodes its hybrid; "
                                      "groups of another size are not in fitrl (full)")


def _resume(v: Any) -> Rule:
    """veRL's ``trainer.resume_mode``: ``auto``, ``disable`` or ``resume_path`` (``resume_from_path``)."""
    name = str(v)
    if name == "auto":
        return to("checkpoint.resume", lambda _: "auto", APPROXIMATED,
                  "fitrl resumes only inside a named trainer.run_dir (a timestamped run directory is new each launch)")
    if name == "disable":
        return to("checkpoint.resume", lambda _: "never")
    return Rule(lambda v, src: [("checkpoint.resume", src["trainer.resume_from_path"])]
                if src.get("trainer.resume_from_path") else [], TRANSLATED,
                "the checkpoint trainer.resume_from_path names")


def _keep_latest(v: Any) -> Rule:
    """``remove_previous_ckpt(_in_save)``: keep the newest checkpoint only."""
    if is_true(v):
        return to("checkpoint.save_limit", lambda _: 1)
    return Rule(None, TRANSLATED, KEEP_ALL)


def _device(v: Any) -> Rule:
    if str(v) in ("cuda", "cpu"):
        return to("trainer.device")
    return drop(f"fitrl runs on CUDA GPUs or the CPU, not {v}")


def _rollout_is(v: Any) -> Rule:
    """veRL's ``rollout_is``: the importance weight per ``token`` or per ``sequence`` (null: off)."""
    if str(v) in ("token", "sequence"):
        return to("algorithm.rollout_correction.mode", lambda v: str(v), TRANSLATED,
                  "truncated at algorithm.rollout_correction.cap (veRL's rollout_is_threshold)")
    return Rule(None, TRANSLATED, "no correction, as fitrl's algorithm.rollout_correction.mode=off")


def _tis_cap(v: Any, src: dict) -> list[tuple[str, Any]]:
    cap = float(v)
    return [("algorithm.rollout_correction.mode", "token"), ("algorithm.rollout_correction.cap", cap)] if cap > 0 else []


def _use_token_level_loss(v: Any, src: dict) -> list[tuple[str, Any]]:
    return [("algorithm.loss_agg_mode", "token-mean" if is_true(v) else "seq-mean-token-mean")]


def _ref_ulysses(v: Any, src: dict) -> list[tuple[str, Any]]:
    return []  # fitrl's reference runs on the actor's ranks and with its sequence parallelism


VERL_MORE: dict[str, Rule] = {
    # older veRL's names of settings fitrl has
    "actor_rollout_ref.model.use_rmpad": to("actor.packing", bool, why="older veRL's use_remove_padding"),
    "critic.model.use_rmpad": to("critic.packing", bool, why="older veRL's use_remove_padding"),
    "data.shuffle_train_dataloader": to("data.shuffle", why="older veRL's data.shuffle"),
    "actor_rollout_ref.actor.use_token_level_loss": Rule(
        _use_token_level_loss, TRANSLATED, "older veRL's loss_agg_mode (token-mean, or seq-mean-token-mean)"),
    "custom_reward_function.overlong_buffer.enable": to("algorithm.overlong.enable",
                                                        why="an older DAPO recipe's place"),
    "custom_reward_function.overlong_buffer.len": to("algorithm.overlong.buffer_length"),
    "custom_reward_function.overlong_buffer.penalty_factor": to("algorithm.overlong.penalty_factor"),
    "actor_rollout_ref.actor.fsdp_config.grad_offload": drop(GRAD_OFFLOAD),
    "critic.model.fsdp_config.grad_offload": drop(GRAD_OFFLOAD),
    # settings fitrl has under names of its own
    "actor_rollout_ref.actor.optim.clip_grad": to("actor.optim.grad_clip"),
    "critic.optim.clip_grad": to("critic.optim.grad_clip"),
    "critic.optim.betas": to("critic.optim.betas", list),
    "actor_rollout_ref.model.tokenizer_path": to("actor.model.tokenizer_path"),
    "critic.model.tokenizer_path": to("critic.model.tokenizer_path"),
    "actor_rollout_ref.rollout.prompt_length": to("data.max_prompt_length"),
    "actor_rollout_ref.rollout.ignore_eos": to("rollout.ignore_eos"),
    "actor_rollout_ref.rollout.do_sample": Rule(lambda v, src: [] if is_true(v) else [("rollout.temperature", 0.0)],
                                                TRANSLATED, "no sampling is greedy decoding: temperature 0"),
    "actor_rollout_ref.rollout.max_model_len": drop(MODEL_LEN),
    "trainer.device": Rule(None, choose=_device),
    # truncated importance sampling of the engine's samples (fitrl's algorithm.rollout_correction)
    "algorithm.rollout_correction.rollout_is": Rule(None, choose=_rollout_is),
    "algorithm.rollout_correction.rollout_is_threshold": to("algorithm.rollout_correction.cap", float),
    "algorithm.rollout_correction.rollout_rs": drop(REJECTION),
    "algorithm.rollout_correction.rollout_rs_threshold": drop(REJECTION),
    "algorithm.rollout_correction.bypass_mode": drop("veRL's shortcut that trains on the engine's log-probs: fitrl "
                                                     "recomputes them (algorithm.recompute_old_logprob)"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": drop("fitrl's weights are truncated, not normalised "
                                                                    "over the batch"),
    "algorithm.rollout_correction.loss_type": drop("the loss the correction weights: algorithm.policy_loss"),
    "actor_rollout_ref.actor.tis_imp_ratio_cap": Rule(_tis_cap, TRANSLATED, "older veRL's token-level TIS (-1: off)"),
    # the critic's optimizer as the actor's
    "critic.optim.lr_warmup_steps": Rule(lambda v, src: warmup_steps(v, src, "critic.optim.warmup_steps"), TRANSLATED),
    "critic.optim.lr_warmup_steps_ratio": warmup_ratio("critic.optim.lr_warmup_steps", "trainer.total_training_steps",
                                                       "critic.optim.warmup_steps"),
    "critic.optim.warmup_style": to("critic.optim.lr_schedule"),
    "critic.optim.min_lr_ratio": to("critic.optim.min_lr_ratio", lambda v: v or 0.0),
    # sharding and parallelism
    "actor_rollout_ref.actor.strategy": Rule(None, choose=_engine_kind),
    "critic.strategy": Rule(None, choose=_engine_kind),
    "actor_rollout_ref.actor.fsdp_config.strategy": Rule(None, choose=_engine_kind),
    "critic.model.fsdp_config.strategy": Rule(None, choose=_engine_kind),
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": _fsdp_size("actor"),
    "actor_rollout_ref.ref.fsdp_config.fsdp_size": _fsdp_size("ref"),
    "critic.model.fsdp_config.fsdp_size": _fsdp_size("critic"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Rule(
        _ref_ulysses, TRANSLATED, "fitrl's reference log-probs run on the actor's ranks, with actor.ulysses_size"),
    "critic.ulysses_sequence_parallel_size": drop("fitrl's critic has no sequence parallelism yet (actor.ulysses_size "
                                                  "is the policy's and the reference's)"),
    "actor_rollout_ref.hybrid_engine": drop("veRL's actor and rollout in one process: fitrl's policy ranks generate "
                                            "and train too (rollout.workers=0, the default)"),
    "trainer.use_legacy_worker_impl": drop("which of veRL's worker implementations runs: fitrl has one"),
    # the engine
    "actor_rollout_ref.rollout.max_num_batched_tokens": drop(VLLM_DEFAULT),
    "actor_rollout_ref.rollout.max_num_seqs": drop(VLLM_DEFAULT),
    "actor_rollout_ref.rollout.multi_stage_wake_up": drop("an SGLang memory setting: fitrl's engine is vLLM, whose "
                                                          "rollout.sleep_level says what sleeps between rollouts"),
    "actor_rollout_ref.rollout.over_sample_rate": drop("veRL's agent loop stops the slowest requests (this fraction) "
                                                       "early: fitrl waits for every sample"),
    "actor_rollout_ref.rollout.data_parallel_size": drop("fitrl runs one vLLM engine per tensor-parallel group of the "
                                                         "policy's ranks"),
    "actor_rollout_ref.rollout.expert_parallel_size": drop("fitrl runs one vLLM engine per tensor-parallel group of "
                                                           "the policy's ranks"),
    "actor_rollout_ref.model.torch_dtype": drop(
        "not a key of veRL's model config (HFModelConfig has no torch_dtype): veRL's actor computes in "
        "actor_rollout_ref.actor.fsdp_config.dtype (bf16 by default, as the import has it)"),
    "actor_rollout_ref.model.exclude_modules": LORA_EXCLUDE,
    "actor_rollout_ref.actor.entropy_checkpointing": drop("veRL's recomputation of the entropy in backward: no fitrl "
                                                          "setting"),
    "actor_rollout_ref.actor.tau_pos": drop(SAPO),
    "actor_rollout_ref.actor.tau_neg": drop(SAPO),
    "actor_rollout_ref.actor.use_torch_compile": drop("veRL compiles its entropy-from-logits function: fitrl computes "
                                                      "log-probs and entropy in chunks, uncompiled (fitrl/ops/logprob.py)"),
    "trainer.balance_batch": Rule(None, TRANSLATED, "fitrl always gives each data-parallel rank equal sequence counts "
                                                    "with similar token totals (fitrl/workers/group.py): the same "
                                                    "gradients, only which rank computes which sequence changes"),
    "data.filter_overlong_prompts_workers": drop("workers of veRL's prompt-length filter: fitrl measures the prompts "
                                                 "at start-up"),
    # DAPO's overlong punishment as veRL's dapo reward manager's kwargs (its recipe's newer scripts)
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": to("algorithm.overlong.enable", why=OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": to("algorithm.overlong.buffer_length", int, why=OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": to("algorithm.overlong.penalty_factor", float,
                                                                        why=OVERLONG),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": drop("whether the dapo manager logs the penalty: what is "
                                                               "logged, not what is trained"),
    "reward_model.reward_kwargs.max_resp_len": drop("the dapo reward manager's own limit: fitrl's overlong ramp ends "
                                                    "at rollout.max_response_length (data.max_response_length), which "
                                                    "veRL's scripts set to the same number"),
    # the reward model served beside the trainer
    "reward_model.use_reward_loop": drop(REWARD_LOOP),
    "reward_model.num_workers": drop(REWARD_LOOP),
    # the run's housekeeping
    "trainer.val_only": to("trainer.val_only"),
    "trainer.resume_mode": Rule(None, choose=_resume),
    "trainer.resume_from_path": drop("read with trainer.resume_mode=resume_path"),
    "trainer.remove_previous_ckpt_in_save": Rule(None, choose=_keep_latest),
    "trainer.remove_previous_ckpt": Rule(None, choose=_keep_latest),  # (older veRL; simpleRL-reason)
    "trainer.max_actor_ckpt_to_keep": Rule(lambda v, src: [("checkpoint.save_limit", int(v))] if v else [],
                                           TRANSLATED, KEEP_ALL),
    "trainer.max_critic_ckpt_to_keep": drop("fitrl's checkpoint holds the actor and the critic together "
                                            "(checkpoint.save_limit)"),
    "trainer.del_local_ckpt_after_load": drop("fitrl keeps the checkpoint it resumed from"),
    "trainer.default_hdfs_dir": drop("veRL copies checkpoints to HDFS: fitrl writes them below trainer.output_dir"),
    # forks: Search-R1 (its search-agent loop), simpleRL-reason
    "actor_rollout_ref.rollout.n_agent": to("rollout.n", status=APPROXIMATED,
                                            why="Search-R1's samples per prompt (its fork of veRL's rollout.n)"),
    "actor_rollout_ref.actor.state_masking": drop(f"Search-R1 masks retrieved passages out of the loss: {AGENTS}, "
                                                  f"which never train on tool output"),
    "data.max_start_length": drop(f"a limit of Search-R1's own search loop: {AGENTS} (rollout.agent.max_turns, "
                                  f"rollout.agent.max_tool_output_tokens)"),
    "data.max_obs_length": drop(f"a limit of Search-R1's own search loop: {AGENTS} (rollout.agent.max_turns, "
                                f"rollout.agent.max_tool_output_tokens)"),
    "max_turns": drop(f"Search-R1's search loop: {AGENTS} (rollout.agent.max_turns with rollout.agent.env)"),
    "algorithm.no_think_rl": drop("Search-R1's switch to train without the think span: no fitrl setting"),
    "trainer.remove_clip": drop("simpleRL-reason's switch to train without the PPO clip: fitrl clips "
                                "(actor.clip_ratio_low, actor.clip_ratio_high)"),
    "actor_rollout_ref.rollout.micro_rollout_batch_size": drop("simpleRL-reason's generation micro-batch: fitrl's "
                                                               "vLLM engine takes the whole batch"),
}
"""veRL keys beyond :data:`fitrl.config.import_maps.VERL`."""

VERL_MORE_PREFIXES: dict[str, Rule] = {
    "actor_rollout_ref.actor.megatron.": drop(MEGATRON),
    "actor_rollout_ref.ref.megatron.": drop(MEGATRON),
    "critic.megatron.": drop(MEGATRON),
    "reward_model.rollout.": drop(REWARD_LOOP),
    "actor_rollout_ref.model.override_config.": drop("veRL's overrides of the model's config.json (dropout, attention "
                                                     "kernel): fitrl builds the model from config.json as it is"),
    "ray_kwargs.": drop("veRL's ray.init arguments (its runtime environment, the Python its workers run): fitrl "
                        "starts or joins Ray itself (trainer.backend=ray, docs/distributed.md)"),
    "global_profiler.": drop("veRL's profiler (what is measured, not what is trained): no fitrl setting"),
    "retriever.": drop(f"Search-R1's search service: a fitrl agent calls it from a tool function "
                       f"(rollout.agent.tools, docs/agents.md)"),
    "reranker.": drop(f"Search-R1's search service: a fitrl agent calls it from a tool function "
                      f"(rollout.agent.tools, docs/agents.md)"),
}

EASYR1_MORE: dict[str, Rule] = {
    # EasyR1 0.2 (before v0.3.0): the KL and the clip under worker.actor (fitrl/config/import_kl.py)
    "worker.actor.use_kl_loss": v02_use_kl_loss(),
    "worker.actor.kl_loss_coef": v02_loss_kl("algorithm.kl_coef"),
    "worker.actor.kl_loss_type": v02_kl_loss_type(),
    "worker.actor.clip_ratio": Rule(lambda v, src: [("actor.clip_ratio_low", v), ("actor.clip_ratio_high", v)]),
    "worker.actor.ulysses_sequence_parallel_size": to("actor.ulysses_size", lambda v: max(1, int(v or 1)),
                                                      why="EasyR1's older name of worker.actor.ulysses_size"),
    "trainer.remove_previous_ckpt": Rule(None, choose=_keep_latest),
    "trainer.remove_ckpt_after_load": drop("fitrl keeps the checkpoint it resumed from"),
    "worker.rollout.ignore_eos": to("rollout.ignore_eos"),
    "worker.rollout.max_num_batched_tokens": drop(VLLM_DEFAULT),
    "worker.rollout.max_num_seqs": drop(VLLM_DEFAULT),
    "worker.actor.tau_positive": drop(SAPO),
    "worker.actor.tau_negative": drop(SAPO),
}
"""EasyR1 keys beyond :data:`fitrl.config.import_maps.EASYR1`."""

EASYR1_MORE_PREFIXES: dict[str, Rule] = {}


REWARD_KWARGS = "custom_reward_function.reward_kwargs."


def per_key_rules(fmt: str, flat: dict[str, Any]) -> dict[str, Rule]:
    """Rules named by the key itself: veRL's ``custom_reward_function.reward_kwargs.<name>``, the
    keyword arguments veRL passes the user's function, become fitrl's ``reward.kwargs.<name>``;
    its ``distillation.teacher_models.<name>.model_path``, fitrl's teacher when it names one; a
    router replay mode, dropped when the source's engine is one fitrl runs as vllm."""
    if fmt != "verl":
        return {}
    own = bool(flat.get("custom_reward_function.path"))
    return {**{key: to(f"reward.kwargs.{key[len(REWARD_KWARGS):]}", why="a keyword argument of your reward "
                                                                        "function, as veRL passes it")
               if own else drop("an argument of veRL's default scorer: fitrl's by_source takes none")
               for key in flat if key.startswith(REWARD_KWARGS)},
            **teacher_path_rules(flat), **router_replay_rules(flat)}
