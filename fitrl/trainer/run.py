"""Building a run: resolve the run directory, build data, reward and roles, train, clean up."""

from __future__ import annotations

import os
import random
from contextlib import ExitStack, nullcontext

import numpy as np
import torch
from rich.console import Console

from fitrl.checkpoint.manager import CheckpointManager
from fitrl.config import ConfigError, FitrlConfig, save_config
from fitrl.config.layout import RunLayout, run_layout
from fitrl.config.schema import adjustments, check_critic_batch_sizes, derived_batch_numbers
from fitrl.agents.tools import tool_schemas
from fitrl.core.allocator import CUDA_ALLOC_CONF, cuda_alloc_env, preload_env, runtime_env_vars
from fitrl.core.allocator import loaded as allocator_loaded
from fitrl.core.device import ClusterDevices, GPUFacts, cuda_in_use, driving, pick_device, resolve_device
from fitrl.core.errors import DataError, EngineBroken, Hung, WorkerFailed
from fitrl.data.dataset import PromptDataset
from fitrl.models.check import check_model_configs, check_run_models
from fitrl.models.description import RunModels
from fitrl.models.families import media_spec_of
from fitrl.models.hub import resolve_run_refs
from fitrl.roles.model_reward import check_reward_sources
from fitrl.roles.reward_sources import RewardSources
from fitrl.memory.roles import ROLE_PLANNERS
from fitrl.roles.workers import ROLES
from fitrl.rollout.agent import check_agent
from fitrl.rollout.vllm_build import check_vllm_installed
from fitrl.telemetry.run_memory import LoadMemory, write_end_memory
from fitrl.tracking import check_installed
from fitrl.trainer.console_log import ConsoleLog
from fitrl.trainer.loop import RLTrainer
from fitrl.trainer.preflight import PLAN_FILE, preflight, write_plan
from fitrl.trainer.rundir import check_shared, open_run_dir
from fitrl.trainer.sft import SFTTrainer, supervised_config
from fitrl.trainer.signals import SIGNALS
from fitrl.trainer.watchdog import collective_timeout_s
from fitrl.workers.group import InProcessWorkerGroup, RoleHandle


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_datasets(cfg: FitrlConfig, tokenizer,
                   models: RunModels | None = None) -> tuple[PromptDataset | None, PromptDataset | None]:
    """``models``: the run's model descriptions (without them the policy's directory is read)."""
    d = cfg.data
    # a vision-language policy (None for a text model): image rows, pixel budget, tokenizer check
    vision = models.actor.media_spec if models is not None else media_spec_of(cfg.actor.model.path)
    tools = tool_schemas(cfg.rollout.agent.tools) if cfg.rollout.agent.enabled else None  # in every prompt
    train = None
    if not cfg.trainer.val_only:
        if not d.train_files:
            raise ConfigError("data.train_files is empty: give at least one jsonl/json/parquet file")
        train = PromptDataset.from_config(d.train_files, tokenizer, d, name="train", vision=vision, tools=tools)
    val = PromptDataset.from_config(d.val_files, tokenizer, d, name="val", vision=vision, tools=tools) if d.val_files else None
    if train is not None and len(train) < d.rollout_batch_size:
        # The sampler would wrap around within each step: the same prompts twice in one batch, a
        # group-relative advantage computed over duplicates, and no word about it.
        dropped = (f" ({train.num_filtered} of {train.num_rows} rows are longer than data.max_prompt_length="
                   f"{d.max_prompt_length})" if train.num_filtered else "")
        raise DataError(f"train: {len(train)} prompts{dropped} but data.rollout_batch_size={d.rollout_batch_size} "
                        f"draws {d.rollout_batch_size} per step, so every step would repeat prompts; add prompts or "
                        f"lower data.rollout_batch_size to {len(train)} or less")
    return train, val


def _quiet_transformers() -> None:
    """transformers' per-file progress bars would interleave with the step lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def make_group(role: str, cfg: FitrlConfig, name: str, stack: ExitStack,
               colocate_with: RoleHandle | None = None, models: RunModels | None = None) -> RoleHandle:
    """The workers of ``role`` (a name in ``ROLES``) on the configured backend; torn down when
    ``stack`` closes. A role without a memory planner (fitrl/memory/roles.py) is refused: it would
    run unplanned. ``models``: the run's model descriptions, handed to every rank (pickled to a
    Ray rank), so no rank reads a model's ``config.json`` again.

    Under Ray, the reference and critic ranks share the policy's slots rank by rank (same node,
    same GPU): the roles take turns, and the planner counts their memory per phase.
    """
    if role not in ROLE_PLANNERS:
        raise ValueError(f"role {role!r} has no memory planner (fitrl/memory/roles.py, ROLE_PLANNERS): "
                         f"its memory would not be planned")
    worker_cls = ROLES.get(role)
    t = cfg.trainer
    # the training passes of the policy and the reference split sequences over actor.ulysses_size ranks
    sequence_parallel = cfg.actor.ulysses_size if role in ("actor", "ref") else 1
    # rollout workers of their own (rollout.workers): a group of their own, on bundles (devices) of
    # their own; in one process a thread beside the driver's (fitrl/trainer/pipeline.py)
    own = role == "rollout"
    if t.backend == "inprocess":
        group = InProcessWorkerGroup(worker_cls, cfg, threaded=own, models=models)
        stack.callback(group.shutdown)
        return RoleHandle(group)
    from fitrl.workers.ray_group import RayWorkerGroup, ensure_ray

    ensure_ray(address=t.ray_address)
    SIGNALS.reinstall()  # ray.init replaces the SIGTERM handler with its own sys.exit
    # collectives time out just above the hang watchdog's largest limit (it fires and reports first;
    # a dead peer is still an error naming the rank), and after an hour where a phase has none
    world, nnodes, per_node = (cfg.rollout.workers, 1, None) if own else (cfg.world_size, t.nnodes, t.devices_per_node)
    group = RayWorkerGroup(worker_cls, cfg, world_size=world, nnodes=nnodes,
                           devices_per_node=per_node, use_gpu=resolve_device(t.device).type == "cuda",
                           name=name, colocate_with=colocate_with.group if colocate_with else None,
                           dist_timeout_s=collective_timeout_s(t.hang_timeout_s, t.hang_timeouts),
                           placement_timeout_s=t.placement_timeout_s,
                           env_vars=_worker_env(cfg), models=models)
    stack.callback(group.shutdown)
    return RoleHandle(group, sequence_parallel=sequence_parallel)


def _sequence_parallel_text(cfg: FitrlConfig) -> str:
    u = cfg.actor.ulysses_size
    return f", Ulysses groups of {u}: {cfg.data_parallel_size} data-parallel" if u > 1 else ""


def train(cfg: FitrlConfig, console: Console | None = None, supervised: bool = False,
          where: dict | None = None) -> list[dict[str, float]]:
    """Run ``cfg``; after a dead worker or a hang, start again from the newest checkpoint up to
    ``trainer.max_restarts`` times (the same run directory: its metrics read as one run).
    ``supervised``: supervised fine-tuning on the answers instead of RL (``fitrl sft``,
    fitrl/trainer/sft.py). ``where``: receives ``run_dir``, the run's directory."""
    console = console or Console(soft_wrap=True)
    check_vllm_installed({cfg.rollout.engine})  # one line before Ray starts or a model loads
    _host_allocator(cfg.memory.host_allocator, console)
    with _run_devices(cfg, console, supervised):
        return _train_restarting(cfg, console, where, supervised)


def _train_restarting(cfg: FitrlConfig, console: Console, where: dict | None, supervised: bool) -> list[dict[str, float]]:
    """:func:`train` once its devices are known."""
    cfg = cfg.with_device_defaults(resolve_device(cfg.trainer.device).type)  # (bf16 on CUDA)
    _device_allocator(cfg, console)
    restarts, event = 0, None
    where = {} if where is None else where
    if supervised:
        where["notes"] = supervised_config(cfg)
    while True:
        try:
            return _train_once(cfg, console, where, restart_event=event, supervised=supervised)
        except (WorkerFailed, Hung, EngineBroken) as e:
            if restarts >= cfg.trainer.max_restarts or "run_dir" not in where:
                raise
            restarts += 1
            cause = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            console.print(f"[yellow]restart {restarts} of trainer.max_restarts={cfg.trainer.max_restarts}[/]: {cause}; "
                          f"the worker groups are rebuilt and the run resumes from its newest checkpoint in "
                          f"{where['run_dir']}", highlight=False)
            # the same directory, resumed from its newest complete checkpoint (none: from step 0)
            cfg.trainer.run_dir, cfg.checkpoint.resume = str(where["run_dir"]), "auto"
            event = {"event": "restart", "restart": restarts, "cause": cause}


def _run_devices(cfg: FitrlConfig, console: Console, supervised: bool = False):
    """Under Ray: connect to the cluster, and drive it for the run (fitrl/core/device.py): devices
    resolved from its GPUs, which the head node need not have, and no ``torch.cuda`` call in this
    process, whose ranks' work is elsewhere; a cluster with fewer GPUs than the run's ranks take
    is one line now, not a placement that waits and times out. In-process: nothing (this
    process's CUDA)."""
    t = cfg.trainer
    if t.backend != "ray":
        return nullcontext()
    if t.device == "cpu":  # nothing to ask the cluster: Ray starts with the first worker group, after the checks
        return driving(ClusterDevices(gpus=0, probe=_no_gpu_probe))
    from fitrl.workers.ray_group import cluster_devices, ensure_ray

    ensure_ray(address=t.ray_address)
    devices = cluster_devices()
    kind = pick_device(t.device, devices.gpus, "the Ray cluster").type  # cuda without GPUs: one line, exit 2
    if t.device == "auto":  # the head node's own CUDA is not asked: say where the ranks go
        has = f"has {devices.gpus} GPU(s)" if devices.gpus else "has no GPU"
        console.print(f"trainer.device=auto: {kind}, the Ray cluster {has}", highlight=False)
    if kind == "cuda":
        check_gpu_count(cfg, devices.gpus, supervised)
    return driving(devices)


def check_gpu_count(cfg: FitrlConfig, gpus: int, supervised: bool = False) -> None:
    """One GPU per rank of the policy's group (the reference, critic and reward roles share its
    slots) and per rollout worker of its own the run starts (fitrl/config/layout.py): more than
    ``gpus``, the cluster's, is a ConfigError."""
    t, layout = cfg.trainer, run_layout(cfg, supervised)
    workers = layout.rollout.count if layout.rollout else 0
    need = layout.devices
    if need > gpus:
        asked = f"trainer.nnodes={t.nnodes} x trainer.devices_per_node={t.devices_per_node}"
        asked += f" + rollout.workers={workers}" if workers else ""
        raise ConfigError(f"{asked} take {need} GPU(s), one each, but the Ray cluster has {gpus}: lower "
                          f"trainer.devices_per_node (or rollout.workers), or join more nodes (`ray start --address`)")


def _no_gpu_probe() -> GPUFacts:
    raise RuntimeError("trainer.device=cpu: no GPU is asked for")


def _host_allocator(allocator: str, console: Console) -> None:
    """``memory.host_allocator`` for the processes this one starts (``LD_PRELOAD`` in the
    environment they inherit), and a line saying which processes run it."""
    if allocator == "glibc":
        return
    os.environ["LD_PRELOAD"] = preload_env(allocator)["LD_PRELOAD"]
    here = "this process and" if allocator_loaded(allocator) else (
        "not this one (started without it: the fitrl command restarts itself with it), only")
    console.print(f"host allocator: {allocator} ({os.environ['LD_PRELOAD'].split()[0]}) in {here} the processes "
                  f"it starts", highlight=False)


def _device_allocator(cfg: FitrlConfig, console: Console) -> None:
    """``memory.expandable_segments`` on a GPU run: in the environment of this process (read when
    CUDA initialises, which has not happened yet) and so of every process it starts."""
    if resolve_device(cfg.trainer.device).type != "cuda":
        return
    vllm_sleeps = cfg.rollout.capabilities.sleeps and cfg.rollout.sleep_level != 0  # (auto: 1 or 2)
    env, why = cuda_alloc_env(cfg.memory.expandable_segments, vllm_sleeps)
    os.environ.update(env)
    # (a Ray driver never initialises CUDA: its ranks start with the settings, fitrl/core/device.py)
    late = " (CUDA was initialised before: this process keeps its settings)" if env and cuda_in_use() else ""
    console.print(f"GPU allocator: expandable segments {why}{late}", highlight=False)


def _worker_env(cfg: FitrlConfig) -> dict:
    """What every Ray rank's process must start with (a joined cluster's workers, or those of an
    earlier ``ray.init``, are not this process's children)."""
    env = runtime_env_vars(cfg.memory.host_allocator)
    if CUDA_ALLOC_CONF in os.environ and resolve_device(cfg.trainer.device).type == "cuda":
        env[CUDA_ALLOC_CONF] = os.environ[CUDA_ALLOC_CONF]
    return env


def build_groups(cfg: FitrlConfig, layout: RunLayout, stack: ExitStack, run_dir,
                 models: RunModels | None = None) -> dict[str, RoleHandle]:
    """The worker groups of the roles ``layout`` lists, in its order, by role name: the policy's
    first (the others colocate on its bundles); a role another stands in for is that role's
    handle (LoRA's reference: the policy with its adapters off)."""
    if layout.builds("critic"):  # (a config check: before any model loads)
        check_critic_batch_sizes(cfg, world_size=cfg.world_size)
    first, *others = layout.roles
    policy = make_group(first.name, cfg, first.group, stack, models=models)
    if cfg.trainer.backend == "ray":  # ranks write their shards where they see run_dir: one directory for all
        check_shared(run_dir, policy.group)
    groups = {first.name: policy}
    for role in others:
        groups[role.name] = groups[role.model] if not role.own_model else make_group(
            role.name, cfg, role.group, stack, colocate_with=policy if role.colocated else None, models=models)
    return groups


def _train_once(cfg: FitrlConfig, console: Console, where: dict, restart_event: dict | None = None,
                supervised: bool = False) -> list[dict[str, float]]:
    _quiet_transformers()
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    check_installed(cfg.trainer.loggers)  # a tracker's missing package: one line, before anything loads
    with ExitStack() as stack:
        stack.enter_context(SIGNALS.handled())  # SIGTERM like SIGINT: one line, workers shut down (trainer/signals.py)
        # The run directory first: created, proven writable and locked (for the whole run, released
        # last) before anything loads; nothing in it is read or written before the lock is held.
        lock = stack.enter_context(open_run_dir(cfg.trainer, notice=lambda line: console.print(line, highlight=False)))
        run_dir = where["run_dir"] = lock.path
        console_log = stack.enter_context(ConsoleLog(console, run_dir))  # what it prints from here: console.log
        resolve_run_refs(cfg, run_dir)  # Hub ids -> snapshot directories of the HF cache, recorded (fitrl/models/hub.py)
        # every model's config.json read once, its family picked once: what every step below and
        # every rank reads instead of the directories (fitrl/models/description.py)
        models = RunModels.read(cfg)
        check_model_configs(cfg, models.configs())  # config.json of every model: what the memory plan reads
        layout = run_layout(cfg, supervised)  # the groups built below: what preflight plans for this mode
        plan = preflight(cfg, console, supervised, models=models)  # memory.plan: stops a run predicted not to fit
        # Cheap checks before any model is loaded: a typo in the reward, a broken model directory
        # or bad data fails in seconds.
        agent = cfg.rollout.agent
        reward = stack.enter_context(RewardSources(cfg.reward, agent_reward=agent.reward if agent.enabled else ""))
        tokenizer = check_run_models(cfg, models.configs())  # weights' headers, the tokenizer (loaded once, here)
        check_agent(cfg, tokenizer)  # the environment imports, the tools' schemas render in the chat template
        check_reward_sources(cfg, models)  # reward models' and judges' directories and chat templates
        train_data, val_data = build_datasets(cfg, tokenizer, models)
        where["val_prompts"] = len(val_data) if val_data is not None else 0  # (what a verdict's noise is over)
        checkpoints = CheckpointManager(cfg, run_dir, console)
        resume = checkpoints.resume_point()  # config checked against the checkpoint's before any model loads
        save_config(cfg, run_dir / "config.yaml")
        console_log.keep()  # the checks passed: the run writes its files, its console log among them
        if plan is not None:  # `fitrl report` draws these predictions beside the measured memory
            write_plan(plan, run_dir / PLAN_FILE)
        else:  # an earlier run's plan in this directory would be drawn against this run's memory
            (run_dir / PLAN_FILE).unlink(missing_ok=True)
        history = []
        if resume is not None and not cfg.trainer.val_only:
            history = checkpoints.carry_metrics(resume)
            if resume.step >= cfg.trainer.max_steps:
                console.print(f"checkpoint {resume.path} is at step {resume.step}, trainer.max_steps="
                              f"{cfg.trainer.max_steps}: nothing to train (raise trainer.max_steps to go on)",
                              highlight=False)
                return history
        elif not cfg.trainer.val_only:  # step 0 in a directory that may hold an earlier run's metrics
            checkpoints.restart_metrics()

        with LoadMemory(cfg.memory.telemetry) as load:  # its memory: a metrics.jsonl event (telemetry/run_memory.py)
            groups = build_groups(cfg, layout, stack, run_dir, models)
        policy, ref, critic, rollout, teacher = (groups.get(name) for name in ("actor", "ref", "critic", "rollout",
                                                                              "teacher"))
        reward.attach(groups.get("reward_model"), groups.get("judge"))

        numbers = derived_batch_numbers(cfg, world_size=cfg.data_parallel_size)
        console.print(f"[bold]fitrl[/] run dir: {run_dir}")
        console.print(f"model: {cfg.actor.model.path} ({policy.num_parameters() / 1e6:.2f}M params, "
                      f"{cfg.actor.model.dtype}) on {resolve_device(cfg.trainer.device)} x {cfg.world_size} "
                      f"({cfg.trainer.backend}{_sequence_parallel_text(cfg)}); reference: {_reference_text(cfg, ref)}; "
                      f"critic: {'yes' if critic else 'none'}{_teacher_text(cfg, teacher)}")
        for ds in (train_data, val_data):
            if ds is not None:
                console.print(ds.summary(), highlight=False)
        console.print("batch: " + ", ".join(f"{k}={v}" for k, v in numbers.items()), highlight=False)
        if rollout is not None:
            console.print(_rollout_text(cfg), highlight=False)
        for note in where.get("notes", []) + adjustments(cfg):
            console.print(f"note: {note}", highlight=False)

        trainer = (SFTTrainer if supervised else RLTrainer)(cfg, policy=policy, ref=ref, critic=critic, train_data=train_data, val_data=val_data,
                            reward=reward, run_dir=run_dir, console=console,
                            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                            checkpoints=checkpoints, history=history, models=models,
                            **({"rollout": rollout} if rollout else {}),
                            **({"teacher": teacher} if teacher else {}))
        stack.callback(trainer.close)
        if resume is not None:
            trainer.restore(resume)
        if restart_event is not None:  # (after the resume rewrote metrics.jsonl to the checkpoint's step)
            trainer.writer.write({"step": resume.step if resume is not None else 0, **restart_event})
        load.write(trainer.writer.write, trainer.memory.driver, resumed=resume is not None)
        history = trainer.fit()
        write_end_memory(trainer.writer.write, trainer.memory.collect, max(trainer.step, trainer.start_step))
    console.print(f"metrics: {run_dir / 'metrics.jsonl'}")
    return history


def _rollout_text(cfg: FitrlConfig) -> str:
    r = cfg.rollout
    where = "Ray actors" if cfg.trainer.backend == "ray" else "a thread beside the trainer"
    lag = {"sync": "each step trains on its own samples",
           "one_step_off": "step k+1 generates while step k trains (samples 1 update old)",
           "async": f"up to {r.max_staleness} steps ahead, new weights taken between micro-batches"}[r.mode]
    return f"rollout: {r.workers} worker(s) of their own ({where}), mode {r.mode}: {lag}"


def _teacher_text(cfg: FitrlConfig, teacher: RoleHandle | None) -> str:
    if teacher is None:
        return ""
    d = cfg.algorithm.distill
    loss = f"{d.loss}, top {d.top_k}" if d.top_k else d.loss
    return (f"; teacher: {cfg.teacher.model.path} ({teacher.num_parameters() / 1e6:.2f}M params, {loss}, "
            f"weight {d.weight:g})")


def _reference_text(cfg: FitrlConfig, ref: RoleHandle | None) -> str:
    if ref is None:
        return "none (KL off)"
    return "the policy with LoRA adapters off" if cfg.actor.lora.enabled else "yes"
