"""``fitrl`` command line: a thin entry point that builds objects and hands over.

Subcommands import their heavy dependencies (torch, transformers) lazily so that ``--help``
and structural config errors (unknown keys, wrong types) answer in well under a second; a
misspelt registry name costs the import of the registries (torch, ~2 s) first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from fitrl.core.errors import Hung, Interrupted, RunStopped, UserError, WorkerFailed  # standard library only
from fitrl.core.intermixed import IntermixedParser  # (standard library only too)


def _load(config: str | None, overrides: list[str]):
    import fitrl.rollout, fitrl.sharding  # noqa: E401,F401  (registered: the load checks their names)
    from fitrl.config import load_config

    return load_config(config, overrides)


_LAUNCH = {"cwd": os.getcwd(), "own_argv": False}  # where and how this process was started (main() sets own_argv)


def _under_allocator(cfg) -> None:
    """Restart this command under ``memory.host_allocator`` (preloaded) unless it runs under it:
    only the config has been read so far (fitrl/core/allocator.py). Only when this process is the
    command (``main()`` parsed the process's own argv): called from Python, it keeps running and
    only the processes it starts get the allocator."""
    if not _LAUNCH["own_argv"]:
        return
    from fitrl.core.allocator import reexec_with

    reexec_with(cfg.memory.host_allocator, cwd=_LAUNCH["cwd"])


def cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.overrides)  # its `plan:` section feeds the memory plan before the run
    _under_allocator(cfg)
    from fitrl.trainer.run import train

    train(cfg)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.overrides)
    _under_allocator(cfg)
    from fitrl.trainer.run import train

    train(cfg, supervised=True)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from fitrl.models.tiny import describe, make_tiny_model

    if args.train_on:
        if args.head != "reward" or args.arch != "qwen2" or args.size != "tiny":
            print("fitrl: --train-on arith trains a tiny qwen2 reward model: give --head reward (and the default "
                  "--arch and --size)", file=sys.stderr)
            return 2
        from fitrl.models.tiny_reward import train_arith_reward_model

        figures = train_arith_reward_model(args.out_dir, seed=args.seed)
        print(f"trained on the arith task: {json.dumps(figures)}")
        out = Path(args.out_dir)
    else:
        out = make_tiny_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed, head_dim=args.head_dim,
                              head=args.head)
    info = describe(out)
    print(f"wrote {out}: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    return 0


def cmd_import_config(args: argparse.Namespace) -> int:
    from fitrl.config import ConfigError
    from fitrl.config.loader import config_from_dict
    from fitrl.config.importer import import_config, nest

    items = [args.source, *args.overrides] if args.source else list(args.overrides)
    source = items[0] if items and "=" not in items[0] else None
    imported = import_config(source, items[1:] if source else items, args.format)
    for line in imported.report():  # (stderr: stdout stays a config to save)
        print(line, file=sys.stderr)
    try:
        config_from_dict(nest(imported.config), source=source or "overrides")
    except ConfigError as e:
        raise ConfigError(f"the imported config does not load: {e}") from None
    text = imported.yaml(source or "command-line overrides")
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:  # a missing folder, no permission, a full disk: the user's path
            raise ConfigError(f"-o {args.output}: cannot write the translated config ({e.strerror or e}): "
                              f"name a file in a folder that exists and you can write to") from None
        print(f"wrote {args.output}: check the approximated and untranslated keys above, then "
              f"`fitrl plan {args.output}`", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from fitrl.config import config_to_dict, describe_fields

    if args.doc:
        for key, type_text, default, doc in describe_fields():
            print(f"{key} ({type_text}, default {default})\n    {doc}")
        return 0
    import yaml

    from fitrl.config.schema import adjustments

    cfg = _load(args.config, args.overrides)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    for note in adjustments(cfg):  # (stderr: the YAML on stdout stays a config to save)
        print(f"note: {note}", file=sys.stderr)
    return 0


def _version() -> str:
    """fitrl's version and the torch it runs with (what a bug report needs first)."""
    import importlib.metadata

    import fitrl

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"{fitrl.__version__} (torch {torch_version})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fitrl", description="RL post-training for LLMs that knows its memory.")
    parser.add_argument("--version", action="version", version=f"fitrl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=IntermixedParser)

    p = sub.add_parser("train", help="run RL training from a YAML config plus dotted overrides")
    p.add_argument("config", help="YAML config, e.g. examples/arith.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=20 actor.optim.lr=1e-5")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("sft", help="supervised fine-tuning on the data's answers (the warm start before RL), "
                                    "from the same YAML config; export its checkpoint to start `train` from it")
    p.add_argument("config", help="YAML config, e.g. examples/arith.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=20 actor.optim.lr=1e-4")
    p.set_defaults(fn=cmd_sft)

    from fitrl.trainer.demo import add_demo_command

    add_demo_command(sub, _load, _under_allocator)  # (standard library only)

    p = sub.add_parser("make-tiny-model", help="write a random-initialised HF model + locally trained tokenizer")
    p.add_argument("out_dir")
    archs = ["qwen2", "llama", "qwen3_moe", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
    p.add_argument("--arch", default="qwen2", choices=archs, help="qwen3_moe: a mixture of experts (4 experts, top "
                   "2); qwen2_vl, qwen2_5_vl, qwen3_vl: vision-language (sizes tiny, small), with the image processor's files")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "medium", "agent"],
                   help="agent: ~1M parameters, its tokenizer trained on tool-calling conversations too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-dim", type=int, default=None, metavar="N",
                   help="attention head size of the decoder (default: the size's own, 16 for tiny): the same width "
                        "in hidden_size/N heads, e.g. 32 for a tiny model vLLM's CPU attention can run")
    p.add_argument("--head", default="causal_lm", choices=["causal_lm", "reward"],
                   help="reward: a reward model (sequence classification, one score) for reward.sources' kind: model")
    p.add_argument("--train-on", choices=["arith"], default=None,
                   help="with --head reward: train it to predict the toy arithmetic task's rule score (about a minute)")
    p.set_defaults(fn=cmd_make_tiny_model)

    from fitrl.checkpoint.export import add_export_command
    from fitrl.checkpoint.verify import add_checkpoint_command
    from fitrl.doctor.command import add_doctor_command
    from fitrl.planner.cli import add_plan_command
    from fitrl.report.command import add_report_command

    add_export_command(sub)
    add_checkpoint_command(sub)
    add_plan_command(sub)
    add_report_command(sub)
    add_doctor_command(sub)

    p = sub.add_parser("import-config", help="translate a veRL or EasyR1 config, launch script or command line "
                                             "into a fitrl config, one line per key (docs/switching.md)")
    p.add_argument("source", nargs="?", help="a veRL/EasyR1 YAML or launch script (.sh), or the first key=value")
    p.add_argument("overrides", nargs="*", help="key=value as the source's own command line takes them")
    p.add_argument("-o", "--output", help="write the fitrl YAML here (default: stdout)")
    p.add_argument("--format", choices=["auto", "verl", "easyr1"], default="auto",
                   help="the source's framework (default: told from its keys)")
    p.set_defaults(fn=cmd_import_config)

    p = sub.add_parser("config", help="print the resolved config, or every key with its documentation (--doc)")
    p.add_argument("config", nargs="?", help="YAML config (omit for the defaults)")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--doc", action="store_true", help="list every key, its type, default and meaning")
    p.set_defaults(fn=cmd_config)
    _add_debug_flag(parser, sub)
    return parser


DEBUG_HELP = "show the Python traceback of every error (also FITRL_DEBUG=1); by default a user's mistake is one line"


def _add_debug_flag(parser: argparse.ArgumentParser, sub) -> None:
    """``--debug`` before or after the command: ``fitrl --debug train ...`` and ``fitrl train ... --debug``.
    SUPPRESS on the subcommands keeps their parse from resetting the top-level value to False."""
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def _debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("FITRL_DEBUG", "").strip() not in ("", "0")


def _enable_faulthandler() -> None:
    """A segfault in native code (a reward function scored in the driver with reward.num_workers=0,
    a tokenizer, a kernel) kills the process before Python can say anything; faulthandler at least
    prints the Python stack of the crash, which names the file and function that were running."""
    import faulthandler

    if faulthandler.is_enabled():  # pytest, PYTHONFAULTHANDLER: already on, keep their file
        return
    try:
        faulthandler.enable(file=sys.__stderr__, all_threads=False)
    except (AttributeError, ValueError, OSError):  # no usable stderr file descriptor (embedded use)
        pass


def _one_line(prefix: str, error: BaseException, debug: bool) -> None:
    """``fitrl: <prefix>: <message>`` on stderr; with ``debug`` the traceback comes first."""
    if debug:
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(f"fitrl: {prefix}: {error}", file=sys.stderr)


BUG_REPORT = ("fitrl: internal error: this is a bug in fitrl, not a mistake in your input. Please report it to the "
              "fitrl maintainers with the command line, the config (`fitrl config CONFIG ...` prints it resolved) and "
              "the traceback above")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    debug = _debug_requested(args)
    _LAUNCH["own_argv"] = argv is None
    _enable_faulthandler()
    try:
        return args.fn(args)
    except UserError as e:  # config, data, model directory, reward file, run directory, a named checkpoint
        _one_line(e.kind, e, debug)
        return 2
    except RunStopped as e:
        _one_line("run stopped", e, debug)
        return 1
    except WorkerFailed as e:
        _one_line("worker failed", e, debug)
        return 1
    except Hung as e:  # a phase without progress (fitrl/trainer/watchdog.py): its stacks are printed above
        print(f"fitrl: hang: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:  # SIGINT/SIGTERM during a run (fitrl/trainer/signals.py): 130 / 143
        print(f"fitrl: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        print("fitrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _is_memory_pressure(e):  # the guard outside the trainer's handling: no traceback either
            _one_line("run stopped by the memory guard", e, debug)
            return 1
        import traceback

        traceback.print_exc()  # an unexpected error: the traceback is what a bug report needs
        print(BUG_REPORT, file=sys.stderr)
        return 1


def _is_memory_pressure(error: BaseException) -> bool:
    if "fitrl.telemetry.guard" not in sys.modules:  # never raised if never imported: skip the import
        return False
    from fitrl.telemetry.guard import MemoryPressure

    return isinstance(error, MemoryPressure)


if __name__ == "__main__":
    sys.exit(main())
