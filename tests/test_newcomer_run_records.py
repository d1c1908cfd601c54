"""Issue 65, what a run leaves behind: progress with an ETA where the console is not a terminal
(fitrl/trainer/logging.py), the console's output in ``<run_dir>/console.log``
(fitrl/trainer/console_log.py), and the memory of the load, the final validation and the final
save in metrics.jsonl (fitrl/telemetry/run_memory.py)."""

import io
import re

from rich.console import Console

from fitrl.trainer.console_log import ConsoleLog
from fitrl.trainer.logging import make_progress
from helpers import read_metrics, toy_config

ANSI = re.compile(r"\x1b\[")


def test_a_console_that_is_not_a_terminal_gets_progress_lines_with_an_eta():
    now = [0.0]
    out = io.StringIO()
    console = Console(file=out, width=100)  # a file: not a terminal
    assert not console.is_terminal
    with make_progress(console, True, every_s=60, clock=lambda: now[0]) as progress:
        task = progress.add_task("train", total=10, completed=2)  # resumed after step 2
        for step in range(3, 11):
            now[0] += 25.0  # 25 s a step
            progress.console.print(f"step {step}")
            progress.advance(task)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("progress:")]
    assert lines == ["progress: step 5/10 (50%), elapsed 0:01:15, ETA 0:02:05",  # 3 steps in 75 s, 5 left
                     "progress: step 8/10 (80%), elapsed 0:02:30, ETA 0:00:50",
                     "progress: step 10/10 (100%), elapsed 0:03:20, done"]


def test_no_progress_lines_when_the_bar_is_off_or_on_a_terminal():
    for console, enabled in ((Console(file=io.StringIO()), False),
                             (Console(file=io.StringIO(), force_terminal=True), True)):
        with make_progress(console, enabled, every_s=0) as progress:
            task = progress.add_task("train", total=2)
            progress.advance(task)
            progress.advance(task)
        assert "progress:" not in console.file.getvalue()


def test_the_console_log_copies_prints_as_plain_text_and_notes_the_error(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True)  # colours on the screen
    try:
        with ConsoleLog(console, tmp_path) as log:
            console.print("[bold]fitrl[/] run dir: here")  # before keep(): held in memory
            assert not (tmp_path / "console.log").exists()
            assert log.keep() == tmp_path / "console.log"
            console.print("step 1")
            raise RuntimeError("the reason\nand its details")
    except RuntimeError:
        pass
    console.print("after the run")
    log = (tmp_path / "console.log").read_text()
    assert ANSI.search(out.getvalue()) and not ANSI.search(log)
    assert log.splitlines()[1:] == ["fitrl run dir: here", "step 1", "stopped: RuntimeError: the reason"]
    assert "print" not in vars(console)  # the console is itself again


def test_a_run_stopped_by_its_checks_writes_no_log_and_a_later_start_its_own(tmp_path):
    console = Console(file=io.StringIO())
    try:
        with ConsoleLog(console, tmp_path):
            console.print("refused")
            raise ValueError("a config error")
    except ValueError:
        pass
    assert list(tmp_path.iterdir()) == []  # (a new run directory stays empty: removed with the lock)
    for text in ("first", "resumed", "resumed again"):
        with ConsoleLog(console, tmp_path) as log:
            log.keep()
            console.print(text)
    logs = {p.name: p.read_text().splitlines()[1:] for p in tmp_path.iterdir()}
    assert logs == {"console.log": ["first"], "console-2.log": ["resumed"], "console-3.log": ["resumed again"]}


def test_a_short_run_saves_its_console_and_the_memory_outside_its_steps(tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    out = io.StringIO()
    cfg = toy_config(tiny_model_dir, run, "trainer.max_steps=2", "trainer.val_before_train=false",
                     "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
                     "actor.micro_batch_size=4", "trainer.progress_bar=true")
    train(cfg, Console(file=out, width=120))
    screen, log = out.getvalue(), (run / "console.log").read_text()
    # the console's lines, in the run directory too (the last line, naming metrics.jsonl, comes after)
    for text in ("run dir: ", "step    1 |", "step    2 |", "validation @ step 2:", "checkpoint: ",
                 "progress: step 2/2 (100%), elapsed"):
        assert text in screen and text in log, text
    assert log.startswith("--- ") and not ANSI.search(log)
    # the memory no step record holds: the load, then the final validation and save
    events = [r for r in read_metrics(run, memory_events=True) if r.get("event") == "memory"]
    assert [(e["at"], e["step"]) for e in events] == [("load", 0), ("end", 2)]
    load, end = events
    assert load["mem/rank0/load/host_peak_gib"] >= load["mem/rank0/load/host_rss_gib"] > 0
    assert end["mem/rank0/validation/host_peak_gib"] > 0 and end["mem/rank0/checkpoint_save/host_peak_gib"] > 0
    steps = [r for r in read_metrics(run) if "event" not in r and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert not any(k.startswith(("mem/rank0/validation/", "mem/rank0/load/")) for r in steps for k in r)

    # resumed for a third step: a console log of its own, the first left alone; no second load
    # event (metrics.jsonl reads as one run), the end of the third step's run
    first = log
    train(toy_config(tiny_model_dir, run, "trainer.max_steps=3", "trainer.val_before_train=false",
                     "data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
                     "actor.micro_batch_size=4"), Console(file=io.StringIO(), width=120))
    assert (run / "console.log").read_text() == first
    assert "step    3 |" in (run / "console-2.log").read_text()
    events = [r for r in read_metrics(run, memory_events=True) if r.get("event") == "memory"]
    assert [(e["at"], e["step"]) for e in events] == [("load", 0), ("end", 2), ("end", 3)]
