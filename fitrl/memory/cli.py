"""``fitrl plan CONFIG [overrides] --nodes N --gpus-per-node G --gpu-memory 80GiB --host-memory 2TiB``.

Wired into the main parser by ``fitrl.cli`` through :func:`add_plan_command`. Exit status: 0
when the plan fits, 1 when it does not, 2 on a configuration error (raised as ConfigError).
"""

from __future__ import annotations

import argparse
import os

from fitrl.config import ConfigError


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="predict GPU and host memory per process and phase before launching; recommend changes",
        description="Predict peak GPU memory per device and host memory per node for each phase of a run, "
                    "say whether it fits (GPU <= 90%%, host <= 85%%), and rank changes that make it fit. "
                    "Needs only the model's config.json (actor.model.path may hold nothing else).")
    p.add_argument("config", nargs="?", help="YAML config (may carry a planner-only `plan:` section)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.micro_batch_size=2 or plan.rollout.engine=vllm")
    p.add_argument("--nodes", type=int, help="nodes (default: plan.hardware.nodes, else trainer.nnodes)")
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default: plan.hardware, else trainer.devices_per_node)")
    p.add_argument("--gpu-memory", help="memory of one device, e.g. 80GiB (default 80GiB)")
    p.add_argument("--host-memory", help="RAM of one node, e.g. 2TiB (default 2TiB)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="plan a CUDA run (default) or a CPU run (default with trainer.device=cpu; host = this machine's RAM)")
    p.add_argument("--no-recommend", action="store_true", help="skip the recommendations (faster)")
    p.set_defaults(fn=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    from fitrl.memory.inputs import load_plan_config, plan_inputs_from_dict

    cfg, section = load_plan_config(args.config, args.overrides)
    hw = section.setdefault("hardware", {})
    for flag, key in (("nodes", "nodes"), ("gpus_per_node", "gpus_per_node"), ("gpu_memory", "gpu_memory"),
                      ("host_memory", "host_memory"), ("device", "device")):
        if getattr(args, flag) is not None:
            hw[key] = getattr(args, flag)
    hw.setdefault("nodes", cfg.trainer.nnodes)
    hw.setdefault("gpus_per_node", cfg.trainer.devices_per_node)
    if cfg.trainer.device == "cpu":
        hw.setdefault("device", "cpu")
    if hw.get("device") == "cpu":  # a CPU run: this machine's RAM unless told
        hw.setdefault("host_memory", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        hw.setdefault("gpu_memory", 0)
    inputs = plan_inputs_from_dict(section)
    return run_plan(cfg, inputs, recommend_changes=not args.no_recommend)


def run_plan(cfg, inputs, recommend_changes: bool = True, console=None) -> int:
    from fitrl.memory.plan import plan_config
    from fitrl.memory.recommend import recommend
    from fitrl.memory.report import print_plan
    from fitrl.memory.shapes import ModelShape

    try:
        shape = ModelShape.from_path(cfg.actor.model.path)
    except FileNotFoundError:
        raise ConfigError(f"actor.model.path={cfg.actor.model.path!r} has no config.json: the planner needs "
                          "the model's config.json (nothing else)") from None
    except ValueError as e:
        raise ConfigError(f"actor.model.path={cfg.actor.model.path!r}: {e}") from None
    plan = plan_config(cfg, inputs.hardware, inputs, shape=shape)
    recs, combo = recommend(plan) if recommend_changes else ([], None)
    print_plan(plan, recs, combo, console)
    return 0 if plan.fits else 1
