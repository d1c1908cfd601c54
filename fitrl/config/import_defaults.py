"""What a key the source leaves out means there: each source framework's defaults layer for
``fitrl import-config`` (:mod:`fitrl.config.importer`).

A layer is written in the source's own dotted keys and merged under what the source sets, so the
key-by-key maps of :mod:`fitrl.config.import_maps` translate a default exactly as they translate
the same key set by hand (and report it, marked as the source's default). Each layer mirrors the
source's published defaults (tests/data/foreign/defaults/, each file headed by its repository,
path and commit) for the keys that change what is trained or the memory it takes: the values
tests/test_import_defaults.py checks against that file. Every other key of the file whose
translation differs from fitrl's default is in :data:`LEFT_TO_FITRL`, with why.
"""

from __future__ import annotations

from typing import Any

VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    # veRL ties the critic's mini-batch (256 prompts, not fitrl's 8), epochs and loss aggregation
    # to the actor's: its own interpolations, resolved against what the source sets
    "critic.ppo_mini_batch_size": "${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}",
    "critic.ppo_epochs": "${oc.select:actor_rollout_ref.actor.ppo_epochs,1}",
    "critic.loss_agg_mode": "${oc.select:actor_rollout_ref.actor.loss_agg_mode,token-mean}",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01, "critic.optim.weight_decay": 0.01,
    # FSDP mixed precision: bf16 compute on fp32 weights, fp32 gradient reduction, for the actor,
    # the reference and the critic (fitrl's fsdp.mixed_precision is that policy)
    "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16", "actor_rollout_ref.ref.fsdp_config.dtype": "bfloat16",
    "critic.model.fsdp_config.dtype": "bfloat16",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True, "critic.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5, "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1,
}
"""veRL (``verl.trainer.main_ppo``): tests/data/foreign/defaults/verl/_generated_ppo_trainer.yaml."""

EASYR1_DEFAULTS: dict[str, Any] = {
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.rollout_batch_size": 512,
    "data.min_pixels": 262144, "data.max_pixels": 4194304,
    "algorithm.adv_estimator": "grpo",
    # the KL goes into the reward unless use_kl_loss (import_rules.easyr1_kl_mode), k1 at 1e-3
    "algorithm.use_kl_loss": False, "algorithm.kl_penalty": "kl", "algorithm.kl_coef": 1e-3,
    "worker.actor.global_batch_size": 256, "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.clip_ratio_low": 0.2, "worker.actor.clip_ratio_high": 0.3,  # clip-higher by default
    "worker.actor.dynamic_batching": True,
    "worker.actor.model.enable_gradient_checkpointing": True, "worker.actor.model.lora.alpha": 64,
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.weight_decay": 0.01,
    # FSDP mixed precision (bf16 compute, fp32 reduction) for the actor and the reference
    "worker.actor.fsdp.mp_param_dtype": "bf16", "worker.ref.fsdp.mp_param_dtype": "bf16",
    "worker.ref.fsdp.torch_dtype": "bf16",
    "worker.rollout.name": "vllm", "worker.rollout.n": 1, "worker.rollout.tensor_parallel_size": 2,
    "worker.rollout.gpu_memory_utilization": 0.6,
    "trainer.max_try_make_batch": 20, "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1,
}
"""EasyR1 (``verl.trainer.main``, whose ``PPOConfig()`` is the base ``config=`` and the command line
merge into): tests/data/foreign/defaults/easyr1/config_defaults.yaml."""

EASYR1_V02_DEFAULTS: dict[str, Any] = {
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.rollout_batch_size": 512,
    "data.min_pixels": 262144, "data.max_pixels": 4194304,
    "algorithm.adv_estimator": "grpo", "algorithm.kl_penalty": "kl", "algorithm.kl_coef": 1e-3,
    # the KL in the actor's loss unless worker.actor.use_kl_loss=false (then in the reward: import_kl.py)
    "worker.actor.use_kl_loss": True, "worker.actor.kl_loss_coef": 1e-3, "worker.actor.kl_loss_type": "low_var_kl",
    "worker.actor.global_batch_size": 256, "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.micro_batch_size_per_device_for_experience": 16,
    "worker.actor.clip_ratio": 0.2, "worker.actor.entropy_coeff": 1e-3,  # one clip ratio; an entropy bonus
    "worker.actor.padding_free": False, "worker.actor.model.enable_gradient_checkpointing": True,
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.weight_decay": 0.01,
    "worker.actor.fsdp.mp_param_dtype": "bf16", "worker.ref.fsdp.mp_param_dtype": "bf16",
    "worker.ref.fsdp.torch_dtype": "bf16",
    "worker.actor.fsdp.enable_rank0_init": False, "worker.ref.fsdp.enable_rank0_init": False,
    "worker.rollout.name": "vllm", "worker.rollout.n": 1, "worker.rollout.tensor_parallel_size": 2,
    "worker.rollout.gpu_memory_utilization": 0.5,
    "worker.reward.compute_score": "math",
    "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1,
}
"""EasyR1 0.2 (0.2.0.dev, until March 2025, before v0.3.0; its layout holds the KL switch under
``worker.actor``): tests/data/foreign/defaults/easyr1-0.2/config_defaults.yaml."""

DEFAULTS: dict[str, dict[str, Any]] = {"verl": VERL_DEFAULTS, "easyr1": EASYR1_DEFAULTS,
                                       "easyr1-0.2": EASYR1_V02_DEFAULTS}
"""Each defaults layer by name: a source framework, or one of its releases (:func:`layer`)."""
SOURCE_NAMES = {"verl": "veRL", "easyr1": "EasyR1", "easyr1-0.2": "EasyR1 0.2"}
LAYOUTS = {"easyr1-0.2": ("easyr1", ("worker.actor.use_kl_loss", "worker.actor.kl_loss_coef",
                                     "worker.actor.kl_loss_type"))}
"""An older release's layer: its framework and the keys only that release's layout has."""


def layer(fmt: str, flat: dict[str, Any]) -> str:
    """The defaults layer a source of ``fmt`` (its dotted keys ``flat``) means: an older release's
    when it sets a key only that release's layout has, else the framework's current one."""
    return next((name for name, (of, keys) in LAYOUTS.items() if of == fmt and any(k in flat for k in keys)), fmt)

BEYOND_FILE: dict[str, dict[str, str]] = {
    "verl": {"actor_rollout_ref.rollout.name": "the file makes it mandatory (???); veRL's ppo_trainer.yaml named "
                                               "vllm before it was split into components, and fitrl's hf engine "
                                               "would plan a run veRL never makes"},
    "easyr1": {"worker.ref.fsdp.torch_dtype": "null in the file: EasyR1's FSDP worker then loads the reference in "
                                              "bf16 (the actor in fp32)"},
    "easyr1-0.2": {"worker.ref.fsdp.torch_dtype": "null in the file: EasyR1's FSDP worker then loads the reference "
                                                  "in bf16 (the actor in fp32)"},
}
"""Layer values the file leaves null or mandatory, and where they come from instead."""

_LOGGED = "what is logged and where, not what is trained"
LEFT_TO_FITRL: dict[str, dict[str, str]] = {
    "verl": {
        "actor_rollout_ref.model.path": "a placeholder: every run names its model",
        "critic.model.path": "a placeholder: fitrl's unset critic.model is the actor's model",
        "data.train_files": "a placeholder: every run names its data", "data.val_files": "a placeholder",
        "actor_rollout_ref.rollout.response_length": "veRL's interpolation of data.max_response_length, which the "
                                                     "layer holds",
        "critic.model.use_remove_padding": "fitrl's padding-free forwards (critic.packing) give the same values "
                                           "on fewer positions",
        "actor_rollout_ref.rollout.free_cache_engine": "fitrl's rollout.sleep_level=auto frees the KV cache too "
                                                       "(and the weights, pushed back after every update)",
        "trainer.project_name": _LOGGED, "trainer.experiment_name": _LOGGED, "trainer.logger": _LOGGED,
        "trainer.log_val_generations": _LOGGED, "trainer.default_local_dir": _LOGGED,
        "trainer.device": "fitrl's auto is CUDA where the run has a GPU (and the CPU where none)",
        "critic.model.tokenizer_path": "veRL's interpolation of the actor's model path: fitrl's critic reads the "
                                       "actor's tokenizer unless told",
    },
    "easyr1": {
        "data.train_files": "every run names its data", "data.val_files": "every run names its data",
        "trainer.project_name": _LOGGED, "trainer.experiment_name": _LOGGED, "trainer.logger": _LOGGED,
        "trainer.val_generations_to_log": _LOGGED,
    },
    "easyr1-0.2": {
        "data.train_files": "every run names its data", "data.val_files": "every run names its data",
        "trainer.project_name": _LOGGED, "trainer.experiment_name": _LOGGED, "trainer.logger": _LOGGED,
        "trainer.val_generations_to_log": _LOGGED,
    },
}
"""Keys of the published file whose translation differs from fitrl's default but that the layer
leaves to fitrl, and why."""


def with_defaults(fmt: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (a source's dotted keys) over its framework's defaults: what the source leaves out
    keeps the source's meaning. The defaults come first, so the source's own keys are read last."""
    return {**DEFAULTS.get(fmt, {}), **flat}
