"""``fitrl plan CONFIG [overrides] --nodes N --gpus-per-node G --gpu-memory 80GiB --host-memory 2TiB``.

Wired into the main parser by ``fitrl.cli`` through :func:`add_plan_command`, whose subcommand
parsers take options and overrides in any order (``fitrl.cli.IntermixedParser``). The config is loaded
as for any command (its ``plan:`` section included); the flags override ``plan.hardware``. Exit
status: 0 when the plan fits or is tight (``fitrl train`` would start), 1 when it does not fit, 2
on a configuration error (raised as ConfigError).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Optional

from fitrl.config import ConfigError, FitrlConfig, load_config
from fitrl.config.plan import parse_bytes
from fitrl.memory.model import Hardware, machine_ram
from fitrl.planner.plan import plan_config
from fitrl.planner.recommend import recommend
from fitrl.planner.report import print_plan
from fitrl.models.shape import ModelShape
from fitrl.models.check import ModelDirError, read_model_config
from fitrl.models.hub import resolve_plan_refs


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="predict GPU and host memory per process and phase before launching; recommend changes",
        description="Predict peak GPU memory per device and host memory per node for each phase of a run, "
                    "say whether it fits, is tight or does not fit (each peak with the plan's error band, against "
                    "what the run may use before fitrl's guard stops it: 97% of a device, a node less 7%), and rank "
                    "changes that make it fit. "
                    "Needs only the model's config.json (actor.model.path may hold nothing else).")
    p.add_argument("config", nargs="?", help="YAML config (its `plan:` section: hardware, rollout engine)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.micro_batch_size=2 or rollout.engine=vllm")
    p.add_argument("--nodes", type=int, help="nodes (default: plan.hardware.nodes, else trainer.nnodes)")
    p.add_argument("--gpus-per-node", type=int,
                   help="devices per node (default: plan.hardware.gpus_per_node, else trainer.devices_per_node)")
    p.add_argument("--gpu-memory", help="memory of one device, e.g. 80GiB (default: plan.hardware.gpu_memory, else 80GiB)")
    p.add_argument("--host-memory", help="RAM of one node, e.g. 2TiB (default: plan.hardware.host_memory, else 2TiB)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="plan a CUDA run or a CPU run (default: where `fitrl train` would run: trainer.device, and "
                        "with auto this machine, unless the flags or plan.hardware name GPUs)")
    p.add_argument("--no-recommend", action="store_true", help="skip the recommendations (faster)")
    p.set_defaults(fn=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    import fitrl.rollout  # noqa: F401  (registers the engines, so the load checks rollout.engine)
    import fitrl.sharding  # noqa: F401  (registers the sharding backends and their planners)

    cfg = load_config(args.config, args.overrides)
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    device, gpu_memory, note = this_machine(cfg, args)
    if note:  # wrapped at the terminal's width (piped: $COLUMNS, else 80), as the tables below are
        print(textwrap.fill(note, shutil.get_terminal_size().columns))
    hardware = Hardware.for_config(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                   gpu_memory=gpu_memory if args.gpu_memory is None else _size(args.gpu_memory,
                                                                                                 "--gpu-memory"),
                                   host_memory=_size(args.host_memory, "--host-memory"), device=device)
    check_hardware(hardware, gpu_source="--gpu-memory" if args.gpu_memory is not None else "plan.hardware.gpu_memory",
                   host_source="--host-memory" if args.host_memory is not None else "plan.hardware.host_memory")
    return run_plan(cfg, hardware, recommend_changes=not args.no_recommend)


def this_machine(cfg: FitrlConfig, args: argparse.Namespace) -> tuple[Optional[str], Optional[int], str]:
    """``(device, device memory, a line saying so)`` when the plan is for this machine: what
    ``fitrl train`` would use with ``trainer.device=auto`` (a visible GPU and its memory, else the
    CPU), unless the flags or ``plan.hardware`` describe other hardware (then ``(args.device, None, "")``)."""
    h = cfg.plan.hardware
    named = (args.device, args.gpu_memory, args.gpus_per_node, args.nodes, h.device, h.gpu_memory, h.gpus_per_node,
             h.nodes)
    if cfg.trainer.device != "auto" or any(v is not None for v in named):
        return args.device, None, ""
    import torch

    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        return "cuda", memory, (f"planning this machine: {torch.cuda.get_device_name(0)}, "
                                f"{memory / 2**30:.1f} GiB (trainer.device=auto; --gpu-memory and --nodes plan "
                                f"other hardware)")
    return "cpu", None, (f"planning this machine: CPU only, {machine_ram() / 2**30:.1f} GiB of RAM (trainer.device=auto "
                         f"finds no GPU; --device cuda --gpu-memory 80GiB plans a GPU run)")


CONFIG_ONLY_MODELS = Path(__file__).resolve().parents[2] / "examples" / "failure_stories" / "models"
"""Model directories holding only a config.json: enough for a plan (a checkout's examples)."""


def _model_config(cfg: FitrlConfig, path: str, what: str) -> dict:
    """The model's config.json; a missing directory that has a config-only copy in the examples
    says how to plan with it."""
    try:
        return read_model_config(path, what)
    except ModelDirError as e:
        copy = CONFIG_ONLY_MODELS / Path(path).name.lower()
        if Path(path).exists() or not (copy / "config.json").is_file():
            raise
        copy = Path(os.path.relpath(copy)) if not os.path.relpath(copy).startswith("../..") else copy
        keys = " ".join(f"{k}={copy}" for k in ("actor.model.path", "ref.model.path", "critic.model.path")
                        if (k == "actor.model.path" and cfg.actor.model.path == path)
                        or (k != "actor.model.path" and getattr(cfg, k.split(".")[0]).model is not None
                            and getattr(cfg, k.split(".")[0]).model.path == path))
        raise ModelDirError(f"{e}; to plan without the weights, its config.json alone is in {copy}: "
                            f"fitrl plan CONFIG {keys}") from None


def _size(text: Optional[str], flag: str) -> Optional[int]:
    return None if text is None else parse_bytes(text, flag)


# Bounds that no real machine falls outside: a size beyond them is a typo (0, a missing unit,
# GB for TB), and planning for it would take seconds to say "does not fit" (or "fits") for nothing.
MIN_MEMORY, MAX_DEVICE_MEMORY, MAX_HOST_MEMORY = 2**30, 16 * 2**40, 2**50


def check_hardware(hardware: Hardware, *, gpu_source: str, host_source: str) -> None:
    """One line for a device or node size that cannot be meant (``--gpu-memory 0`` on a CUDA plan)."""
    def gib(n: int) -> str:
        return f"{n / 2**30:,.0f} GiB" if n >= 2**30 else f"{n:,} bytes"

    if hardware.device == "cuda" and not MIN_MEMORY <= hardware.gpu_memory <= MAX_DEVICE_MEMORY:
        raise ConfigError(f"{gpu_source}: {gib(hardware.gpu_memory)} per device is not a GPU's memory (a CUDA plan "
                          f"needs 1 GiB to 16 TiB per device); write it with its unit, e.g. 80GiB, or plan a CPU run "
                          f"with --device cpu")
    if not MIN_MEMORY <= hardware.host_memory <= MAX_HOST_MEMORY:
        raise ConfigError(f"{host_source}: {gib(hardware.host_memory)} per node is not a machine's RAM (1 GiB to "
                          f"1 PiB); write it with its unit, e.g. 2TiB or 251GB")


def run_plan(cfg: FitrlConfig, hardware: Hardware, recommend_changes: bool = True, console=None) -> int:
    resolve_plan_refs(cfg)  # Hub ids: config.json alone from the HF cache, never the weights (fitrl/models/hub.py)
    # config.json parsed and its shape keys checked first (the reference's and critic's too): one
    # line naming the file, not a KeyError
    config = _model_config(cfg, cfg.actor.model.path, "actor.model.path")
    for role in ("ref", "critic"):
        model = getattr(cfg, role).model
        if model is not None and model.path:
            _model_config(cfg, model.path, f"{role}.model.path")
    try:
        shape = ModelShape.from_dict(config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"actor.model.path={cfg.actor.model.path!r}: {e}") from None
    plan = plan_config(cfg, hardware, shape=shape)
    recs, combo = recommend(plan) if recommend_changes else ([], None)
    print_plan(plan, recs, combo, console)
    return 0 if plan.fits else 1
