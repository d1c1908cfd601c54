"""Issue 65, honest docs: the fit rule docs/memory.md states is the code's (fitrl/memory/model.py,
``Plan.judged``, and the guard's limits of fitrl/config/run.py), and each failure story's verdict
in docs/failure-stories.md is the one its plan gives today (fits, tight or does not fit)."""

import re
from pathlib import Path

import pytest

from fitrl.config.run import MemoryConfig
from helpers import load_bench

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = ("fits", "tight", "does not fit")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:g}"


def test_memory_md_states_the_verdict_rule_and_limits_of_the_code():
    text = (ROOT / "docs" / "memory.md").read_text()
    m = MemoryConfig()
    device, keep = _percent(m.guard_gpu_max_fraction), _percent(m.guard_min_available_fraction)
    # every statement of the limits names the guard's defaults
    assert set(re.findall(r"(\d+) % of a device", text)) == {device}
    assert set(re.findall(r"the (\d+) % the guard keeps", text)) == {keep}
    # no two-valued rule of device / node percentages left (the old "≤ 90 %, every node ≤ 85 %")
    assert not re.search(r"every device ≤ \d+ %", text) and not re.search(r"every node ≤ \d+ %", text)
    plan_section = text.split("## `fitrl train` plans first")[0]  # the section introducing `fitrl plan`
    for word in VERDICTS:
        assert f"**{word}**" in plan_section, word
    assert "exit status 0 on fits and tight" in plan_section and "1 on does not fit" in plan_section


def test_the_plan_command_states_the_same_limits():
    import argparse

    from fitrl.planner.cli import add_plan_command

    m = MemoryConfig()
    plan = add_plan_command(argparse.ArgumentParser(prog="fitrl").add_subparsers())
    assert f"{_percent(m.guard_gpu_max_fraction)}% of a device" in plan.description
    assert f"a node less {_percent(m.guard_min_available_fraction)}%" in plan.description


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _verdict(text: str) -> str:
    return next(v for v in VERDICTS if text.startswith(v))


@pytest.mark.slow  # ten 7B-72B plans (~15 s)
def test_each_failure_story_says_the_verdict_its_plan_gives():
    fs = load_bench("failure_stories")
    rows = {}
    for line in (ROOT / "docs" / "failure-stories.md").read_text().splitlines():
        m = re.match(r"\| (\d) ", line)
        if m and "([config](" in line:  # the first table: a row per story, linking its config
            rows[m.group(1)] = _cells(line)
    assert sorted(rows) == [s.key for s in fs.STORIES]
    for story in fs.STORIES:
        plan_cell, fix_cell = rows[story.key][3], rows[story.key][5]
        assert _verdict(plan_cell) == fs.plan_story(story).verdict, (story.key, plan_cell)
        fixed = fix_cell.split("`: ", 1)[1]  # "`key=value` ...: <verdict>; peaks ..."
        assert _verdict(fixed) == fs.plan_story(story, story.fix.overrides).verdict, (story.key, fix_cell)
