"""``fitrl demo``: make the tiny model and the toy data when missing, warm-start the model with
supervised steps, train GRPO from there and print the verdicts (fitrl/trainer/verdict.py).
The CLI (fitrl/cli.py) registers the subcommand with ``add_demo_command``; standard library only
at import, so ``fitrl --help`` stays fast."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

from fitrl.trainer.verdict import accuracy_gain, collapsed, judge_rise  # (standard library only)

# `fitrl demo` variants: the config (its paths are relative to the repository root), the arch and
# size of the tiny model it builds when missing, what writes the data when a data file is missing
# ("module:function(out_dir, seed)"; None: the data is committed only), and the supervised warm
# start run before GRPO.
DEMOS = {
    "text": ("examples/arith_demo.yaml", "qwen2", "tiny", None, "examples/arith_sft.yaml"),
    "vl": ("examples/shapes_vl_demo.yaml", "qwen2_5_vl", "tiny", "fitrl.data.toy_images:write_shapes_data",
           "examples/shapes_vl_sft.yaml"),
    "reward_model": ("examples/arith_rm.yaml", "qwen2", "tiny", None, "examples/arith_sft.yaml"),
    "tools": ("examples/mul_tools.yaml", "qwen2", "agent", "fitrl.data.toy_tools:write_mul_tools_data",
              "examples/mul_tools_sft.yaml"),
    "distill": ("examples/arith_distill.yaml", "qwen2", "tiny", None, "examples/arith_sft.yaml"),
}
# the demo variants whose teacher (teacher.model.path) is made when missing: its supervised warm
# start and the GRPO config that trains it from there (exported to teacher.model.path)
TEACHERS = {"distill": ("examples/arith_sft.yaml", "examples/arith_teacher.yaml")}
# the demo variants whose reward comes from a model trained for the task, made when missing
# ("module:function(out_dir, seed)", written to reward.sources.<name>.model.path)
REWARD_MODELS = {"reward_model": "fitrl.models.tiny_reward:train_arith_reward_model"}
# overrides of the demo that the warm start takes too (the rest are GRPO's)
WARM_START_KEYS = ("trainer.seed=", "trainer.device=", "trainer.num_threads=", "trainer.progress_bar=")


def add_demo_command(subparsers, load: Callable, on_config: Callable) -> argparse.ArgumentParser:
    """Register ``fitrl demo`` on the CLI's subparsers; ``load`` and ``on_config``: as ``run_demo`` takes them."""
    p = subparsers.add_parser("demo", help="a tiny local model on a toy task (CPU, minutes): arithmetic, "
                                            "warm-started by supervised steps then GRPO; or with --vl questions "
                                            "about pictures (warm-started too)")
    p.add_argument("--vl", action="store_true", help="a tiny vision-language model (Qwen2.5-VL architecture) on "
                                                     "pictures of shapes: examples/shapes_vl_demo.yaml")
    p.add_argument("--reward-model", action="store_true",
                   help="GRPO on the score of a tiny reward model trained for the task (made when missing), the rule "
                        "only logged: examples/arith_rm.yaml")
    p.add_argument("--tools", action="store_true",
                   help="an agent: two-digit products answered through the calculator tool in multi-turn episodes, "
                        "warm-started on demonstration conversations: examples/mul_tools.yaml (docs/agents.md)")
    p.add_argument("--distill", action="store_true",
                   help="on-policy distillation: the warm-started student trained toward a larger local teacher "
                        "(made when missing) on its own samples, mixed with GRPO: examples/arith_distill.yaml")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help="supervised steps before GRPO (default: the warm start config's; 0: none, GRPO "
                        "from the random model)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of examples/arith_demo.yaml (--vl: examples/shapes_vl_demo.yaml)")
    p.set_defaults(fn=lambda args: run_demo(args, load, on_config))
    return p


def run_demo(args: argparse.Namespace, load: Callable, on_config: Callable) -> int:
    """Make the tiny model (and the data) if missing, warm-start it with supervised steps on the
    answers, train GRPO from there, and judge validation accuracy before and after GRPO and the
    reward curve (a collapse to a degenerate policy is called that). ``args``: `fitrl demo`'s
    (fitrl/cli.py); ``load(config, overrides)``: the CLI's config loader; ``on_config(cfg)``: called
    once GRPO's config is read, before anything heavy (the CLI restarts under the host allocator)."""
    variant = next((v for v in ("vl", "reward_model", "tools", "distill") if getattr(args, v, False)), "text")
    config, arch, size, write_data, warm_start = DEMOS[variant]
    root = Path(__file__).resolve().parent.parent.parent
    if not Path(config).is_file() and (root / config).is_file():
        os.chdir(root)  # the demo's data and model paths are relative to the repository root
    cfg = load(config, args.overrides)
    on_config(cfg)
    from rich.console import Console

    from fitrl.models.tiny import make_tiny_model
    from fitrl.trainer.run import train

    console = Console(soft_wrap=True)
    model_dir = Path(cfg.actor.model.path)
    if not (model_dir / "config.json").is_file():
        console.print(f"making a tiny random-initialised {arch} model in {model_dir} (nothing is downloaded)")
        make_tiny_model(model_dir, arch=arch, size=size, seed=cfg.trainer.seed)
    data_files = [Path(f) for f in cfg.data.train_files + cfg.data.val_files]
    if write_data and not all(f.exists() for f in data_files):
        import importlib

        module, name = write_data.split(":")
        console.print(f"writing the toy data to {data_files[0].parent} ({write_data})")
        getattr(importlib.import_module(module), name)(data_files[0].parent, seed=0)
    if variant in REWARD_MODELS:
        _make_reward_models(cfg, REWARD_MODELS[variant], console)
    if variant in TEACHERS:
        make_teacher(cfg, *TEACHERS[variant], args, console, load)
    if warm_start and args.warm_start_steps != 0:
        cfg.actor.model.path = _warm_start(warm_start, model_dir, args, console, cfg.trainer.run_dir, load)
    where: dict = {}
    history = train(cfg, console, where=where)
    verdict = judge_rise([h["reward/mean"] for h in history])
    collapse = collapsed(history, cfg.rollout.max_response_length)
    if collapse and verdict.get("rose"):  # a rise to a degenerate policy is not learning
        verdict["message"] = verdict["message"].replace("rose beyond noise", "rose") + (
            f", but the policy collapsed: {collapse}; it has not learned the task")
    console.print(verdict["message"], highlight=False)
    gain = accuracy_gain(Path(where["run_dir"]) / "metrics.jsonl", prompts=where.get("val_prompts", 0),
                         by="distillation with GRPO" if variant == "distill" else "GRPO")
    if gain is not None:
        console.print(gain["message"], highlight=False)
    if collapse:
        return 1
    if gain is not None:  # validation accuracy says whether GRPO made the policy better
        return 0 if gain["after"] > gain["before"] else 1
    return 1 if verdict.get("judged") and not verdict["rose"] else 0


def _make_reward_models(cfg, maker: str, console) -> None:
    """Train the demo's reward models (``reward.sources`` of kind model) whose directories are missing."""
    import importlib

    module, name = maker.split(":")
    for source, src in cfg.reward.sources.items():
        if src.kind == "model" and not (Path(src.model.path) / "config.json").is_file():
            console.print(f"training the reward model {source} in {src.model.path} to predict the task's rule score "
                          f"({maker}; about two minutes)", highlight=False)
            f = getattr(importlib.import_module(module), name)(src.model.path, seed=0)
            console.print(f"reward model {source}: the right sum outranks every other number for "
                          f"{f['train_right_sum_ranked_first']:.0%} of the train prompts and "
                          f"{f['held_out_right_sum_ranked_first']:.0%} of the held-out ones; held-out correlation "
                          f"with the rule {f['held_out_correlation']:.3f}", highlight=False)


def make_teacher(cfg, warm_start: str, config: str, args: argparse.Namespace, console, load: Callable) -> None:
    """Make the distillation teacher at ``cfg.teacher.model.path`` when it is missing: the demo's
    tiny model (``cfg.actor.model.path``) warm-started by ``warm_start`` and trained by GRPO on
    ``config`` under ``config``'s own seed, exported there. One teacher for every student: the
    demo's seed is not passed on (its device and threads are)."""
    from fitrl.checkpoint.export import export_checkpoint
    from fitrl.trainer.run import train

    out = Path(cfg.teacher.model.path)
    if (out / "config.json").is_file():
        return
    keep = [o for o in args.overrides if o.startswith(WARM_START_KEYS[1:])]
    teacher_cfg = load(config, keep)
    seed = f"trainer.seed={teacher_cfg.trainer.seed}"
    warm = _warm_start(warm_start, Path(cfg.actor.model.path), argparse.Namespace(overrides=[*keep, seed],
                       warm_start_steps=None), console, None, load, title="teacher's warm start",
                       then=f", then {teacher_cfg.trainer.max_steps} GRPO steps ({config})")
    teacher_cfg.actor.model.path = warm
    where: dict = {}
    train(teacher_cfg, console, where=where)
    export_checkpoint(str(where["run_dir"]), str(out))
    console.print(f"teacher exported to {out} (made once; the student's run follows)", highlight=False)


def _warm_start(config: str, model_dir: Path, args: argparse.Namespace, console, run_dir: str | None,
                load: Callable, title: str = "warm start", then: str = ", then GRPO from the result") -> str:
    """``fitrl sft`` on ``config`` from ``model_dir``, exported: the directory GRPO starts from.
    ``run_dir``: GRPO's, when given (the warm start's is beside it, ``<run_dir>-sft``)."""
    from fitrl.checkpoint.export import export_checkpoint
    from fitrl.trainer.run import train

    overrides = [f"actor.model.path={model_dir}", *(o for o in args.overrides if o.startswith(WARM_START_KEYS))]
    if args.warm_start_steps is not None:
        overrides.append(f"trainer.max_steps={args.warm_start_steps}")
    if run_dir:
        overrides.append(f"trainer.run_dir={run_dir}-sft")
    cfg = load(config, overrides)
    console.print(f"[bold]{title}[/]: {cfg.trainer.max_steps} supervised steps on the answers ({config}, "
                  f"fitrl sft){then}", highlight=False)
    where: dict = {}
    train(cfg, console, supervised=True, where=where)
    out = Path(where["run_dir"]) / "hf"
    export_checkpoint(str(where["run_dir"]), str(out))
    console.print(f"{title} exported to {out}", highlight=False)
    return str(out)
