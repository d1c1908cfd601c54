"""Building a run: resolve the run directory, build data, reward and roles, train, clean up."""

from __future__ import annotations

import random
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from fitrl.checkpoint.manager import CheckpointManager
from fitrl.config import ConfigError, FitrlConfig, save_config
from fitrl.config.choices import algorithm_needs
from fitrl.config.schema import check_critic_batch_sizes, derived_batch_numbers
from fitrl.core.device import resolve_device
from fitrl.data.dataset import PromptDataset
from fitrl.models.loading import check_model_dir, load_tokenizer
from fitrl.roles.reward import RewardScorer
from fitrl.roles.workers import CriticWorker, PolicyWorker, ReferenceWorker
from fitrl.trainer.loop import RLTrainer
from fitrl.trainer.preflight import preflight
from fitrl.workers.group import InProcessWorkerGroup, RoleHandle


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_run_dir(cfg: FitrlConfig) -> Path:
    t = cfg.trainer
    if t.run_dir:
        path = Path(t.run_dir)
    else:
        path = Path(t.output_dir) / f"{t.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_datasets(cfg: FitrlConfig, tokenizer) -> tuple[PromptDataset | None, PromptDataset | None]:
    d = cfg.data
    common = dict(prompt_key=d.prompt_key, answer_key=d.answer_key, prompt_template=d.prompt_template,
                  system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template,
                  max_prompt_length=d.max_prompt_length)
    train = None
    if not cfg.trainer.val_only:
        if not d.train_files:
            raise ConfigError("data.train_files is empty: give at least one jsonl/json/parquet file")
        train = PromptDataset(d.train_files, tokenizer, name="train", **common)
    val = PromptDataset(d.val_files, tokenizer, name="val", **common) if d.val_files else None
    return train, val


def _quiet_transformers() -> None:
    """transformers' per-file progress bars would interleave with the step lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def make_group(worker_cls: type, cfg: FitrlConfig, name: str, stack: ExitStack,
               colocate_with: RoleHandle | None = None) -> RoleHandle:
    """One role's workers on the configured backend; torn down when ``stack`` closes.

    Under Ray, the reference and critic ranks share the policy's slots rank by rank (same node,
    same GPU): the roles take turns, and the planner counts their memory per phase.
    """
    t = cfg.trainer
    if t.backend == "inprocess":
        return RoleHandle(InProcessWorkerGroup(worker_cls, cfg))
    from fitrl.workers.ray_group import RayWorkerGroup, ensure_ray

    ensure_ray(address=t.ray_address)
    group = RayWorkerGroup(worker_cls, cfg, world_size=cfg.world_size, nnodes=t.nnodes,
                           devices_per_node=t.devices_per_node, use_gpu=resolve_device(t.device).type == "cuda",
                           name=name, colocate_with=colocate_with.group if colocate_with else None)
    stack.callback(group.shutdown)
    return RoleHandle(group)


def train(cfg: FitrlConfig, console: Console | None = None) -> list[dict[str, float]]:
    console = console or Console(soft_wrap=True)
    _quiet_transformers()
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    check_model_dir(cfg.actor.model.path)
    preflight(cfg, console)  # memory.plan: stops a run predicted not to fit before anything loads
    with ExitStack() as stack:
        # Cheap checks before any model is loaded: a typo in the reward or data fails in seconds.
        reward = stack.enter_context(RewardScorer(cfg.reward))
        tokenizer = load_tokenizer(cfg.actor.model)
        train_data, val_data = build_datasets(cfg, tokenizer)
        run_dir = make_run_dir(cfg)
        checkpoints = CheckpointManager(cfg, run_dir, console)
        resume = checkpoints.resume_point()  # config checked against the checkpoint's before any model loads
        save_config(cfg, run_dir / "config.yaml")
        history = []
        if resume is not None and not cfg.trainer.val_only:
            history = checkpoints.carry_metrics(resume)
            if resume.step >= cfg.trainer.max_steps:
                console.print(f"checkpoint {resume.path} is at step {resume.step}, trainer.max_steps="
                              f"{cfg.trainer.max_steps}: nothing to train (raise trainer.max_steps to go on)",
                              highlight=False)
                return history

        needs = algorithm_needs(cfg)
        policy = make_group(PolicyWorker, cfg, "policy", stack)
        ref = None
        if needs.reference:  # with LoRA the policy's frozen base is the reference: no second model
            ref = policy if cfg.actor.lora.enabled else make_group(ReferenceWorker, cfg, "ref", stack, colocate_with=policy)
        critic = None
        if needs.critic:
            check_critic_batch_sizes(cfg, world_size=cfg.world_size)
            critic = make_group(CriticWorker, cfg, "critic", stack, colocate_with=policy)

        numbers = derived_batch_numbers(cfg, world_size=policy.world_size)
        console.print(f"[bold]fitrl[/] run dir: {run_dir}")
        console.print(f"model: {cfg.actor.model.path} ({policy.num_parameters() / 1e6:.2f}M params, "
                      f"{cfg.actor.model.dtype}) on {resolve_device(cfg.trainer.device)} x {cfg.world_size} "
                      f"({cfg.trainer.backend}); reference: {_reference_text(cfg, ref)}; "
                      f"critic: {'yes' if critic else 'none'}")
        for ds in (train_data, val_data):
            if ds is not None:
                console.print(ds.summary(), highlight=False)
        console.print("batch: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), highlight=False)

        trainer = RLTrainer(cfg, policy=policy, ref=ref, critic=critic, train_data=train_data, val_data=val_data,
                            reward=reward, run_dir=run_dir, console=console,
                            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                            checkpoints=checkpoints, history=history)
        stack.callback(trainer.close)
        if resume is not None:
            trainer.restore(resume)
        history = trainer.fit()
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")
    return history


def _reference_text(cfg: FitrlConfig, ref: RoleHandle | None) -> str:
    if ref is None:
        return "none (KL off)"
    return "the policy with LoRA adapters off" if cfg.actor.lora.enabled else "yes"
