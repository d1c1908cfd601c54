"""Issue 65: a subcommand's options and overrides in any order (``fitrl plan CONFIG --flag key=value``),
on every command that takes overrides (fitrl/cli.py, ``IntermixedParser``)."""

from pathlib import Path

import pytest

from fitrl.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
ARITH = str(ROOT / "examples" / "arith.yaml")


@pytest.mark.parametrize("argv, config, overrides, flags", [
    (["plan", "c.yaml", "--no-recommend", "a.b=1", "c.d=2"], "c.yaml", ["a.b=1", "c.d=2"], {"no_recommend": True}),
    (["plan", "--gpu-memory", "80GiB", "c.yaml", "a.b=1", "--nodes", "2", "c.d=2"], "c.yaml", ["a.b=1", "c.d=2"],
     {"gpu_memory": "80GiB", "nodes": 2}),
    (["plan", "c.yaml", "a.b=1", "--no-recommend"], "c.yaml", ["a.b=1"], {"no_recommend": True}),
    (["train", "c.yaml", "a.b=1", "--debug", "c.d=2"], "c.yaml", ["a.b=1", "c.d=2"], {"debug": True}),
    (["sft", "c.yaml", "--debug", "a.b=1"], "c.yaml", ["a.b=1"], {"debug": True}),
    (["config", "c.yaml", "--doc", "a.b=1"], "c.yaml", ["a.b=1"], {"doc": True}),
])
def test_options_and_overrides_intermixed(argv, config, overrides, flags):
    args = build_parser().parse_args(argv)
    assert (args.config, args.overrides) == (config, overrides)
    assert {k: getattr(args, k) for k in flags} == flags


def test_other_commands_parse_as_before():
    p = build_parser()
    assert p.parse_args(["demo", "--tools", "trainer.seed=1"]).overrides == ["trainer.seed=1"]
    assert p.parse_args(["demo", "trainer.seed=1", "--tools"]).tools
    assert p.parse_args(["checkpoint", "verify", "runs/x"]).path == "runs/x"  # (a command with subcommands)
    assert p.parse_args(["doctor", "--only", "a", "b"]).only == ["a", "b"]
    args = p.parse_args(["import-config", "run.sh", "-o", "out.yaml", "data.train_batch_size=8"])
    assert (args.source, args.output, args.overrides) == ("run.sh", "out.yaml", ["data.train_batch_size=8"])


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["plan", "c.yaml", "--bogus", "a.b=1"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_fitrl_plan_takes_an_override_after_a_flag(tiny_model_dir, capsys):
    """The issue's command line: a flag, then the override that points at the model."""
    assert main(["plan", ARITH, "--no-recommend", f"actor.model.path={tiny_model_dir}",
                 "actor.micro_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "peak host memory per node" in out
