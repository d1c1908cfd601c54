"""Issue 65, plan wording: the recommendation table is titled by what it lists for the plan's
verdict (fitrl/planner/report.py): a *tight* plan's table lists changes that lower its peaks,
slower ones among them, and is not called "speed-ups that still fit"."""

import io
from pathlib import Path

import pytest
from rich.console import Console

from fitrl.config import load_config
from fitrl.memory import Hardware
from fitrl.planner import plan_config
from fitrl.planner.recommend import recommend
from fitrl.planner.report import RECOMMENDATION_TITLES, print_plan

ROOT = Path(__file__).resolve().parent.parent
QWEN_7B = ROOT / "examples" / "failure_stories" / "models" / "qwen2.5-7b-instruct"


def test_every_verdict_has_its_own_title():
    assert set(RECOMMENDATION_TITLES) == {"fits", "tight", "does not fit"}
    assert len(set(RECOMMENDATION_TITLES.values())) == 3
    assert "speed-up" not in RECOMMENDATION_TITLES["tight"] and "still fit" not in RECOMMENDATION_TITLES["tight"]


@pytest.mark.slow  # a 7B plan and its recommendations re-planned (~7 s)
def test_a_tight_plan_lists_its_slow_downs_under_a_title_that_says_so():
    """Failure story 4 (22,000-token prompts on 8 x A100) plans *tight* today
    (docs/failure-stories.md); its table holds slower changes and is titled for them."""
    cfg = load_config(str(ROOT / "examples" / "failure_stories" / "4_crash_at_step_4.yaml"),
                      [f"actor.model.path={QWEN_7B}", f"ref.model.path={QWEN_7B}"])
    plan = plan_config(cfg, Hardware.for_config(cfg))
    assert plan.verdict == "tight" and plan.fits  # (fits: `fitrl train` starts it)
    recs, combo = recommend(plan, first_fit=True)
    assert any(r.change.cost.startswith("slower") for r in recs), [r.change.cost for r in recs]
    out = io.StringIO()
    print_plan(plan, recs, combo, Console(file=out, width=200))
    text = out.getvalue()
    assert "speed-ups that still fit" not in text
    assert RECOMMENDATION_TITLES["tight"] in text
    assert "\ntight: the limit is inside the plan's band" in text
    assert "to apply: " in text  # a tight plan names the cheapest change that fits clear of the band
