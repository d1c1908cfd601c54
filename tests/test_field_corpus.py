"""The field corpus (bench/field_corpus/): its cases' records hold together, and the search-edge
bound (``search_edges``) is the arithmetic its docstring states, on hand-made rows. Planning the
cases themselves is the bench's job (minutes); nothing here plans a full-size model."""

import re

import pytest
from helpers import load_bench

fc = load_bench("field_corpus")
CASES = fc.load_cases()


def test_every_case_names_a_model_and_an_outcome():
    models = fc.load_models()
    assert len(CASES) >= 20
    for c in CASES:
        assert c["reported"]["model"] in models, c["id"]
        assert c["outcome"]["result"] in ("runs", "oom"), c["id"]
        assert c["source"]["url"].startswith("https://"), c["id"]


@pytest.mark.parametrize("case", [c for c in CASES if c["outcome"].get("search")], ids=lambda c: c["id"])
def test_a_search_record_is_the_summarys_arrows(case):
    """``outcome.search`` restates the script's comment (``32√ → 64× → ...``) that the summary
    quotes: the same sizes, ran and failed, and the case's own size among them with its outcome."""
    s = case["outcome"]["search"]
    steps = re.findall(r"(\d+)([√×])", case["outcome"]["summary"])
    assert steps, case["id"]
    assert sorted(int(n) for n, m in steps if m == "√") == sorted(s["ran"])
    assert sorted(int(n) for n, m in steps if m == "×") == sorted(s["failed"])
    assert (s["size"] in s["ran"]) == (case["outcome"]["result"] == "runs")
    assert (s["size"] in s["failed"]) == (case["outcome"]["result"] == "oom")


def _row(id_, result, caps_gpu, expected_gpu=None):
    row = fc.CaseRow(id=id_, source="https://example.org", reported=result, resource=None)
    row.peaks = {"rollout": (30.0, 10.0), "update": (caps_gpu, 10.0)}
    if expected_gpu is not None:
        row.expected_peaks = {"rollout": (30.0, 10.0), "update": (expected_gpu, 10.0)}
    return row


def _case(id_, result, size, device="80GiB"):
    return {"id": id_, "outcome": {"result": result, "search": {"size": size, "ran": [8, 10], "failed": [14, 11]}},
            "fitrl_config": {"plan": {"hardware": {"gpu_memory": device}}}}


def test_search_edge_floor_by_hand():
    """Ran at 10, failed at 11 and 14. Planned 70 GiB at the caps (60 expected) at 10 and 78 (62)
    at 14: 2.0 GiB per unit at the caps, 0.5 expected; the larger gives the lower floor. Size 11
    needed more than the 80 GiB device, so size 10 more than 80 - 2.0 = 78 GiB: 97.5 %, over the
    usable 97 % (77.6 GiB); a plan calls it fits only by predicting 1 - 77.6 / 78 = 0.5 % low."""
    cases = [_case("a-run", "runs", 10), _case("a-oom", "oom", 14)]
    rows = [_row("a-run", "runs", 70.0, 60.0), _row("a-oom", "oom", 78.0, 62.0)]
    (edge,) = fc.search_edges(cases, rows)
    assert edge["id"] == "a-run" and edge["first_failed"] == 11
    assert edge["per_unit"] == pytest.approx(2.0)
    assert edge["device"] == pytest.approx(80.0)
    assert edge["floor"] == pytest.approx(78.0)
    assert edge["over_margin"]
    assert edge["under_to_pass"] == pytest.approx(1 - 77.6 / 78.0)
    assert edge["step_slack"] == pytest.approx(2.4 / 2.0)  # a real step of 2.4 GiB would put the floor at 77.6


def test_a_search_edge_needs_its_oom_partner_and_a_run():
    cases = [_case("a-run", "runs", 10), _case("a-oom", "oom", 14)]
    assert fc.search_edges(cases[:1], [_row("a-run", "runs", 70.0)]) == []   # no partner planned
    assert fc.search_edges(cases[1:], [_row("a-oom", "oom", 78.0)]) == []    # an OOM is no edge
    # a wide step: the floor drops under the usable memory and nothing is claimed of the run
    wide = [_case("b-run", "runs", 10), _case("b-oom", "oom", 14)]
    rows = [_row("b-run", "runs", 50.0), _row("b-oom", "oom", 90.0)]      # 10 GiB per unit
    (edge,) = fc.search_edges(wide, rows)
    assert edge["floor"] == pytest.approx(70.0) and not edge["over_margin"] and edge["under_to_pass"] == 0.0
